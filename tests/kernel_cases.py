"""Kernel-level GPU cases: canonical inputs, a poisoned output, the float64 oracle.

Not a test file: `test_kernel_gpu.py` runs these under pytest, and
`tests/sanitizer_run.py` runs a few under compute-sanitizer.

The kernel is called through the test-only FFI target `jax_attn_dist_fwd_into`,
whose output is aliased to an operand that we fill with NaN: an element the
kernel does not write stays NaN and fails the comparison.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn_dist import oracle
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist._core import checks
from inputs import register_kernels, sweep_choices, sweep_q_start_and_indices

register_kernels()



@dataclasses.dataclass(frozen=True)
class Case:
    S: int
    H: int
    T: int
    D: int = 576
    N: int = 1000
    B: int | None = None  # None: unbatched
    causal: bool = True
    k_stride: int = 1
    per_batch_q_start: bool = False
    lse_base: str = "2"
    invalid_fraction: float = 0.3
    nonfinite_lse: bool = True
    seed: int = 0

    @property
    def name(self) -> str:
        b = "none" if self.B is None else self.B
        return (f"S{self.S}-H{self.H}-T{self.T}-D{self.D}-N{self.N}-B{b}-c{int(self.causal)}"
                f"-ks{self.k_stride}-pb{int(self.per_batch_q_start)}-lse{self.lse_base}"
                f"-inv{int(self.invalid_fraction * 100)}")


def make_case_inputs(case: Case):
    """numpy canonical inputs (batched, B >= 1) + attn_dist kwargs."""
    rng = np.random.default_rng(case.seed)
    B = 1 if case.B is None else case.B
    S, H, T, D, N, ks = case.S, case.H, case.T, case.D, case.N, case.k_stride
    sm_scale = float(D**-0.5 * rng.uniform(0.5, 2.0))
    q = rng.standard_normal((B, S, H, D)).astype(np.float32).astype(jnp.bfloat16)
    k = rng.standard_normal((B, N, 1, D)).astype(np.float32).astype(jnp.bfloat16)
    q_start, indices = sweep_q_start_and_indices(
        rng, B=B, S=S, T=T, N=N, k_stride=ks, causal=case.causal, per_batch_q_start=case.per_batch_q_start,
        invalid_fraction=case.invalid_fraction)

    kwargs = dict(sm_scale=sm_scale, causal=case.causal, q_start_index=q_start, k_stride=ks,
                  lse_base=case.lse_base)
    lse = oracle.exact_lse(q, k, indices, **kwargs)
    if case.nonfinite_lse:  # +inf, -inf and NaN heads give 0, never NaN
        flat = lse.reshape(-1)
        pick = rng.choice(flat.size, size=min(3, flat.size), replace=False)
        flat[pick] = np.array([np.inf, -np.inf, np.nan])[: len(pick)]
    lse = lse.astype(np.float32)
    return (q, k, indices, lse, q_start), kwargs


def poisoned_kernel_call(q, k, indices, lse, q_start, row_ranges=None, *, sm_scale, causal, k_stride, lse_base,
                         **_):
    """The CUDA kernel on canonical operands, writing into a NaN-filled buffer
    (``row_ranges``: SPEC §6's [B, S, 3], or None)."""
    B, S, H, _D = q.shape
    if row_ranges is None:
        row_ranges = checks.no_row_ranges(B, S)
    T = indices.shape[-1]
    shape = (B, math.ceil(H / 64), S, T)
    poison = jnp.full(shape, jnp.nan, jnp.float32)
    call = jax.ffi.ffi_call(attn_contract.FFI_TEST_TARGET, jax.ShapeDtypeStruct(shape, jnp.float32),
                            input_output_aliases={6: 0})
    return call(q, k, indices, lse, q_start, row_ranges, poison, sm_scale=np.float32(sm_scale), causal=bool(causal),
                k_stride=np.int32(k_stride), lse_base_e=lse_base == "e")


_jitted = jax.jit(poisoned_kernel_call, static_argnames=("sm_scale", "causal", "k_stride", "lse_base"))


def run_kernel(inputs, kwargs):
    q, k, indices, lse, q_start = inputs
    kw = {key: kwargs[key] for key in ("sm_scale", "causal", "k_stride", "lse_base")}
    return np.asarray(_jitted(jnp.asarray(q), jnp.asarray(k), jnp.asarray(indices), jnp.asarray(lse),
                              jnp.asarray(q_start), **kw))


def check_case(case: Case, tol: float = 1e-4):
    """Run the kernel on a case; assert SPEC §3 against the float64 oracle,
    every element written (finite), exact zeros at invalid slots."""
    inputs, kwargs = make_case_inputs(case)
    out = run_kernel(inputs, kwargs)
    q, k, indices, lse, q_start = inputs
    ref = oracle.attn_dist_oracle(q, k, indices, lse, **kwargs)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{case.name}: {np.size(out) - np.isfinite(out).sum()} unwritten/non-finite elements"
    valid = oracle.valid_mask(indices, case.N, causal=case.causal, q_start_index=q_start, k_stride=case.k_stride)
    invalid = np.broadcast_to(~valid[:, None, :, 0, :], out.shape)
    assert (out[invalid] == 0).all(), f"{case.name}: nonzero output at invalid slots"
    if np.abs(ref).max() > 0:
        rel, mx = oracle.spec_errors(out, ref)
        assert rel <= tol and mx <= tol, f"{case.name}: rel {rel:.2e}, max {mx:.2e}"
    return out


def sweep_cases(count: int = 64, seed: int = 2026):
    """Random configurations crossing every axis of the kernel issue's matrix;
    the first ones cover each listed value of each axis at least once."""
    rng = np.random.default_rng(seed)
    axes = dict(
        T=[1, 63, 64, 65, 127, 200, 2048, 2049],
        H=[1, 16, 32, 64, 72, 96, 128, 160],
        D=list(attn_contract.KERNEL_HEAD_DIMS),
        B=[None, 1, 3],
        causal=[True, False],
        per_batch_q_start=[False, True],
        k_stride=[1, 4],
        lse_base=["2", "e"],
        invalid_fraction=[0.0, 0.3, 1.0],
    )
    cases = []
    for i, choice in sweep_choices(axes, count, rng):
        big = choice["T"] >= 2048
        S = int(rng.integers(1, 6 if big else 24))
        N = int(rng.integers(1, 4000))
        cases.append(Case(S=S, N=N, seed=1000 + i, **choice))
    return cases
