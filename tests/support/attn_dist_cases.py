"""attn_dist's kernel cases: records of ``inputs.make_inputs``' arguments,
a call of the kernel into a poisoned output, the check against the float64
oracle, and the sweep of the kernel issue's matrix.

Not a test file: ``attn_dist/test_gpu.py`` runs these on the kernel,
``attn_dist/test_reference.py`` runs the sweep through the jnp path, and
``sanitizer_run.py`` runs a few under compute-sanitizer.

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
from inputs import make_inputs, register_kernels, sweep_choices

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
    indices: str = "sweep"  # or "uniform": make_inputs' two ways to draw the slots
    lse_noise: float = 0.0
    seed: int = 0

    @property
    def name(self) -> str:
        b = "none" if self.B is None else self.B
        name = (f"S{self.S}-H{self.H}-T{self.T}-D{self.D}-N{self.N}-B{b}-c{int(self.causal)}"
                f"-ks{self.k_stride}-pb{int(self.per_batch_q_start)}-lse{self.lse_base}")
        if self.indices == "sweep":
            return name + f"-inv{int(self.invalid_fraction * 100)}"
        return name + f"-{self.indices}-noise{self.lse_noise:g}"


def make_case_inputs(case: Case):
    """numpy canonical inputs (batched, B >= 1; q_start int32 [B]) and the
    attn_dist kwargs (``q_start_index`` = that q_start)."""
    B = 1 if case.B is None else case.B
    q, k, indices, lse, kwargs = make_inputs(
        case.seed, S=case.S, H=case.H, D=case.D, N=case.N, T=case.T, B=B, causal=case.causal,
        k_stride=case.k_stride, lse_base=case.lse_base, q_start_index="batch" if case.per_batch_q_start else None,
        indices=case.indices, invalid_fraction=case.invalid_fraction, lse_noise=case.lse_noise,
        nonfinite_lse=case.nonfinite_lse)
    q_start = np.broadcast_to(np.asarray(kwargs["q_start_index"], np.int32), (B,)).copy()
    kwargs["q_start_index"] = q_start
    return (np.asarray(q), np.asarray(k), np.asarray(indices), np.asarray(lse), q_start), kwargs


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
    every element written (finite), exact zeros at invalid slots, and a
    positive value wherever the oracle's is one a float32 holds (a valid slot
    of a group with a head of finite lse: the kernel drops no valid slot)."""
    inputs, kwargs = make_case_inputs(case)
    out = run_kernel(inputs, kwargs)
    q, k, indices, lse, q_start = inputs
    ref = oracle.attn_dist_oracle(q, k, indices, lse, **kwargs)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{case.name}: {np.size(out) - np.isfinite(out).sum()} unwritten/non-finite elements"
    valid = oracle.valid_mask(indices, case.N, causal=case.causal, q_start_index=q_start, k_stride=case.k_stride)
    invalid = np.broadcast_to(~valid[:, None, :, 0, :], out.shape)
    assert (out[invalid] == 0).all(), f"{case.name}: nonzero output at invalid slots"
    assert (out[ref > 1e-30] > 0).all(), f"{case.name}: zero output on a valid slot of a live group"
    if np.abs(ref).max() > 0:
        rel, mx = oracle.spec_errors(out, ref)
        assert rel <= tol and mx <= tol, f"{case.name}: rel {rel:.2e}, max {mx:.2e}"
    return out


#: Hand-picked cases beside the sweep: uniform slot indices in [-3, N + 3)
#: (out-of-range ones on both sides), an lse with noise (rows that do not
#: sum to 1), per-batch q_start when batched, and the head counts the sweep
#: does not list: 200 (two head tiles, the second partial: 3 groups) and 65
#: (the 96-head tile with one head in its second group).
EDGE_CASES = [
    Case(S=24 if T >= 2048 else 40, N=4096 if T >= 2048 else 300, D=D, H=H, T=T, B=B, causal=causal,
         k_stride=ks, lse_base=base, per_batch_q_start=B is not None, indices="uniform", lse_noise=0.25,
         nonfinite_lse=False, seed=i)
    for i, (D, H, T, B, causal, ks, base) in enumerate([
        (576, 128, 2048, None, True, 1, "2"),
        (576, 64, 128, 2, True, 4, "e"),
        (512, 16, 64, None, False, 1, "e"),
        (512, 96, 65, 3, True, 1, "2"),
        (576, 128, 65, 2, True, 4, "2"),
        (576, 96, 2048, 2, True, 1, "e"),
        (512, 128, 128, None, True, 4, "2"),
        (576, 16, 64, 2, False, 1, "2"),
        (576, 1, 64, None, True, 1, "2"),
        (576, 200, 65, None, True, 1, "e"),
        (576, 72, 130, 2, False, 1, "2"),   # 96-head tile, partial second group
        (512, 65, 64, None, True, 4, "e"),  # 96-head tile, one head in the second group
    ])
]


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
