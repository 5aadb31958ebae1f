"""Indexer-kernel GPU cases: canonical inputs, poisoned outputs, the float64 oracle.

Not a test file: ``indexer/test_gpu.py`` runs these under pytest, and
``sanitizer_run.py`` runs a few under compute-sanitizer.

The kernels are called through the test-only FFI targets
`jax_attn_dist_indexer_fwd_into` and `jax_attn_dist_indexer_bwd_into`, whose
outputs are aliased to operands that we fill with NaN: an element the kernel
does not write stays NaN and fails. (The backward clears d index_k itself
before its atomic sums, so its poison only shows that the clear happened.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from inputs import register_kernels, sweep_choices, sweep_q_start_and_indices
from jax_attn_dist import oracle
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist._core import checks

register_kernels()


@dataclasses.dataclass(frozen=True)
class Case:
    S: int
    HI: int
    T: int
    DI: int = 128
    N: int = 1000
    B: int | None = None
    causal: bool = True
    k_stride: int = 1
    per_batch_q_start: bool = False
    invalid_fraction: float = 0.3
    zero_rows: float = 0.1
    scale: float = 1.0
    seed: int = 0

    @property
    def name(self) -> str:
        b = "none" if self.B is None else self.B
        return (f"S{self.S}-HI{self.HI}-T{self.T}-DI{self.DI}-N{self.N}-B{b}-c{int(self.causal)}-ks{self.k_stride}"
                f"-pb{int(self.per_batch_q_start)}-inv{int(self.invalid_fraction * 100)}")


def make_case_inputs(case: Case):
    """numpy canonical inputs (batched, B >= 1) and the indexer_kl kwargs."""
    rng = np.random.default_rng(case.seed)
    B = 1 if case.B is None else case.B
    S, HI, T, DI, N, ks = case.S, case.HI, case.T, case.DI, case.N, case.k_stride
    index_q = (rng.standard_normal((B, S, HI, DI)) * DI ** -0.25).astype(np.float32).astype(jnp.bfloat16)
    index_k = (rng.standard_normal((B, N, DI)) * DI ** -0.25).astype(np.float32).astype(jnp.bfloat16)
    weights = (rng.standard_normal((B, S, HI)) * HI ** -0.5).astype(np.float32)
    q_start, indices = sweep_q_start_and_indices(
        rng, B=B, S=S, T=T, N=N, k_stride=ks, causal=case.causal, per_batch_q_start=case.per_batch_q_start,
        invalid_fraction=case.invalid_fraction)
    target = rng.random((B, S, T)) * (rng.random((B, S, T)) < 0.8)
    target = (target / np.maximum(target.sum(-1, keepdims=True), 1e-30)).astype(np.float32)
    target[rng.random((B, S)) < case.zero_rows] = 0.0
    kwargs = dict(scale=case.scale, causal=case.causal, q_start_index=q_start, k_stride=ks)
    return (index_q, index_k, weights, indices, target, q_start), kwargs


def poisoned_kernel_call(index_q, index_k, weights, indices, target, q_start, row_ranges=None, *, scale, causal,
                         k_stride):
    """The indexer kernel on canonical operands, writing into NaN-filled buffers
    (``row_ranges``: SPEC §6's [B, S, 3], or None)."""
    row = jax.ShapeDtypeStruct(index_q.shape[:2], jnp.float32)
    if row_ranges is None:
        row_ranges = checks.no_row_ranges(*row.shape)
    poison = jnp.full(row.shape, jnp.nan, jnp.float32)
    call = jax.ffi.ffi_call(indexer_contract.FWD_FFI_TEST_TARGET, (row, row), input_output_aliases={7: 0, 8: 1})
    return call(index_q, index_k, weights, indices, target, q_start, row_ranges, poison, poison + 0.0,
                scale=np.float32(scale), causal=bool(causal), k_stride=np.int32(k_stride))


_jitted = jax.jit(poisoned_kernel_call, static_argnames=("scale", "causal", "k_stride"))


def run_kernel(inputs, kwargs):
    kw = {k: kwargs[k] for k in ("scale", "causal", "k_stride")}
    kl, lse = _jitted(*(jnp.asarray(x) for x in inputs), **kw)
    return np.asarray(kl), np.asarray(lse)


def check_case(case: Case):
    """Run the kernel; every row written; kl within SPEC §3.2 of float64; lse
    close to float64 (exactly -inf on rows with no valid slot); kl exactly 0
    on rows with no positive target on a valid slot."""
    inputs, kwargs = make_case_inputs(case)
    kl, lse = run_kernel(inputs, kwargs)
    index_q, index_k, weights, indices, target, q_start = inputs
    kw = dict(scale=case.scale, causal=case.causal, q_start_index=q_start, k_stride=case.k_stride)
    want = oracle.indexer_kl_oracle(index_q, index_k, weights, indices, target, **kw)
    want_lse = oracle.indexer_lse_oracle(index_q, index_k, weights, indices, **kw)
    assert not np.isnan(kl).any() and not np.isnan(lse).any(), f"{case.name}: unwritten rows"
    assert np.isfinite(kl).all(), case.name
    oracle.assert_indexer_close(kl, want)
    empty = ~np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), ~empty) and np.all(lse[empty] == -np.inf), f"{case.name}: lse of empty rows"
    if (~empty).any():
        err = np.abs(lse[~empty] - want_lse[~empty]).max() / max(1.0, np.abs(want_lse[~empty]).max())
        assert err <= 2e-5, f"{case.name}: lse error {err:.2e}"
    valid = oracle.valid_mask(indices, case.N, causal=case.causal, q_start_index=q_start, k_stride=case.k_stride)
    no_teacher = ~((valid[:, :, 0, :] & (target > 0)).any(axis=-1))
    assert np.all(kl[no_teacher] == 0.0), f"{case.name}: nonzero kl on rows without a target"
    return kl, lse


def sweep_cases(count: int = 40, seed: int = 2027):
    """Random configurations crossing the kernel's axes; the first ones cover
    each listed value of each axis at least once."""
    rng = np.random.default_rng(seed)
    axes = dict(
        T=[1, 63, 64, 65, 200, 2048, 2049],
        HI=[1, 7, 16, 32, 33, 64, 100, 256],
        DI=[64, 128],
        B=[None, 1, 3],
        causal=[True, False],
        per_batch_q_start=[False, True],
        k_stride=[1, 4],
        invalid_fraction=[0.0, 0.3, 1.0],
    )
    cases = []
    for i, choice in sweep_choices(axes, count, rng):
        big = choice["T"] >= 2048
        S = int(rng.integers(1, 5 if big else 20))
        N = int(rng.integers(1, 4000))
        cases.append(Case(S=S, N=N, seed=3000 + i, scale=float(rng.choice([0.5, 1.0, 3.0])), **choice))
    return cases


# ----------------------------------------------------------------------------
# the backward kernel
# ----------------------------------------------------------------------------

#: The backward kernel's gradients against float64 (SPEC §3.2), per element:
#: |err| <= BWD_TOLERANCE * (the sum of the absolute values of its terms)
#: + the terms whose relu mask is ambiguous (|z| ~ 0: the kernel's float32 z
#: and float64 may disagree on its sign) + 1e-6 max |ref|. dz is rounded to bfloat16 for the GEMMs (2^-9 of each
#: term at most) and d index_q / d index_k are returned in bfloat16 (2^-9 of
#: the value): 2^-8 in all; the bound allows twice that.
BWD_TOLERANCE = 2.0 ** -7


def poisoned_bwd_call(index_q, index_k, weights, indices, target, q_start, lse, g, row_ranges=None, *, scale, causal,
                      k_stride, deterministic=False):
    """The backward kernels into NaN-filled d index_q, d weights and
    d index_k (the workspace is scratch and not returned; ``row_ranges``:
    SPEC §6's [B, S, 3], or None)."""
    if row_ranges is None:
        row_ranges = checks.no_row_ranges(*index_q.shape[:2])
    shapes = (jax.ShapeDtypeStruct(index_q.shape, jnp.bfloat16), jax.ShapeDtypeStruct(weights.shape, jnp.float32),
              jax.ShapeDtypeStruct(index_k.shape, jnp.float32))
    workspace = jax.ShapeDtypeStruct(
        (indexer_contract.bwd_workspace_bytes(index_k.shape, deterministic=deterministic),), jnp.uint8)
    poison = [jnp.full(x.shape, jnp.nan, x.dtype) for x in shapes]
    call = jax.ffi.ffi_call(indexer_contract.BWD_FFI_TEST_TARGET, (*shapes, workspace),
                            input_output_aliases={9: 0, 10: 1, 11: 2})
    return call(index_q, index_k, weights, indices, target, q_start, lse, g, row_ranges, *poison,
                scale=np.float32(scale), causal=bool(causal), k_stride=np.int32(k_stride),
                deterministic=bool(deterministic))[:3]


_jitted_bwd = jax.jit(poisoned_bwd_call, static_argnames=("scale", "causal", "k_stride", "deterministic"))


def run_bwd_kernel(inputs, kwargs, lse, g, deterministic=False):
    kw = {k: kwargs[k] for k in ("scale", "causal", "k_stride")}
    outs = _jitted_bwd(*(jnp.asarray(x) for x in inputs), jnp.asarray(lse), jnp.asarray(g),
                       deterministic=deterministic, **kw)
    # Converted on the host: a device-side convert is an XLA kernel outside
    # initcheck's kernel filter, whose output it then takes as never written
    # (1,076,224 reports on the indexer_bwd cases; 0 with this).
    return tuple(np.asarray(x).astype(np.float32) for x in outs)


def bwd_cotangent(case: Case):
    """g [B, S]: normal, with some rows 0."""
    rng = np.random.default_rng(case.seed + 77)
    B = 1 if case.B is None else case.B
    g = rng.standard_normal((B, case.S)).astype(np.float32)
    g[rng.random((B, case.S)) < 0.1] = 0.0
    return g


def assert_bwd_within_bound(got, want, mags, ambiguous, *, label="", zero_if_ref_zero=False):
    """SPEC §3.2's bound for the backward kernel (bf16 dz) on (d index_q,
    d index_k, d weights), the oracle's order (``want, mags, ambiguous`` from
    ``oracle.indexer_grads_oracle(..., magnitudes=True)``): every element
    finite (written), and per element within BWD_TOLERANCE of its terms'
    absolute sum, plus the terms whose relu mask is ambiguous, plus 1e-6
    max |ref|. ``zero_if_ref_zero``: a gradient whose reference is all 0 must
    be exactly 0."""
    for name, a, ref, mag, amb in zip(("d_index_q", "d_index_k", "d_weights"), got, want, mags, ambiguous):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        assert np.isfinite(a).all(), f"{label}{name} unwritten or non-finite"
        top = np.abs(ref).max() if ref.size else 0.0
        if zero_if_ref_zero and top == 0:
            assert np.all(a == 0), f"{label}{name} should be 0"
            continue
        err = np.abs(a - ref)
        bound = BWD_TOLERANCE * mag + amb + 1e-6 * top
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert np.all(err <= bound), (f"{label}{name} error {err[worst]:.3e} > bound {bound[worst]:.3e} at "
                                      f"{worst} (max |ref| {top:.3e})")


def check_bwd_case(case: Case, deterministic=False):
    """The backward kernel on the forward kernel's lse: every element written,
    each gradient within BWD_TOLERANCE of float64, and d index_q / d weights
    exactly 0 on dead rows (no positive target on a valid slot, or g = 0). The
    deterministic mode is held to the same bound: its fixed-point rounding,
    2^-(F+1) per term with 2^-F <= 2^-61 rows x the largest row bound (SPEC
    §5.3), is below 2^-30 of that bound at these sizes."""
    inputs, kwargs = make_case_inputs(case)
    _, lse = run_kernel(inputs, kwargs)
    g = bwd_cotangent(case)
    dq, dw, dk = run_bwd_kernel(inputs, kwargs, lse, g, deterministic=deterministic)
    index_q, index_k, weights, indices, target, q_start = inputs
    want, mags, ambiguous = oracle.indexer_grads_oracle(index_q, index_k, weights, indices, target, g, scale=case.scale,
                                             causal=case.causal, q_start_index=q_start, k_stride=case.k_stride,
                                             magnitudes=True)
    assert_bwd_within_bound((dq, dk, dw), want, mags, ambiguous, label=f"{case.name}: ", zero_if_ref_zero=True)
    valid = oracle.valid_mask(indices, case.N, causal=case.causal, q_start_index=q_start, k_stride=case.k_stride)
    dead = ~((valid[:, :, 0, :] & (target > 0)).any(axis=-1)) | (g == 0)
    assert np.all(dq[dead] == 0) and np.all(dw[dead] == 0), f"{case.name}: nonzero gradient on a dead row"
    return dq, dw, dk


def check_sharded_steps(seed, *, B=2, S=48, HI=64, DI=128, N=700, T=256):
    """The steps an S-sharded deterministic backward takes per shard
    (sharded_fixed_point.py: bound call, fixed-point call, limbs, their
    conversion), run on one GPU with no shard to reduce over: they must give
    the one call's bits for all three gradients (the same scale for B * S
    rows, the limbs exact), with adversarial indices and zero-target rows;
    keys large enough to overflow exp make d index_k NaN in both."""
    from inputs import make_indexer_inputs, require_ffi_targets
    from jax_attn_dist._core import fixed_point
    from jax_attn_dist.ops.indexer.primitive import indexer_kl_bwd_p, indexer_kl_p
    from jax_attn_dist.ops.indexer.sharded_fixed_point import sharded_deterministic_backward

    require_ffi_targets(indexer_contract.BWD_BOUND_FFI_TARGET, indexer_contract.BWD_FIXED_FFI_TARGET,
                        fixed_point.LIMBS_TO_FLOAT_TARGET)
    iq, ik, w, idx, target, kw = make_indexer_inputs(seed, B=B, S=S, HI=HI, DI=DI, N=N, T=T, q_start_index="batch")
    params = dict(scale=kw["scale"], causal=kw["causal"], k_stride=kw["k_stride"], deterministic=True,
                  implementation="cuda")
    q_start = jnp.asarray(kw["q_start_index"], jnp.int32)
    ranges = jnp.zeros((B, S, 0), jnp.int32)
    g = jnp.asarray(np.random.default_rng(seed).standard_normal((B, S)).astype(np.float32))
    _, lse = jax.jit(lambda iq, ik: indexer_kl_p.bind(iq, ik, w, idx, target, q_start, ranges, **params))(iq, ik)

    @jax.jit
    def both(ik):
        ops = (iq, ik, w, idx, target, q_start, ranges, lse, g)
        return indexer_kl_bwd_p.bind(*ops, **params), sharded_deterministic_backward(
            ops, params, bound_axes=(), sum_axes=(), scale_rows=B * S)

    for case in ("finite", "overflowing keys"):
        keys = ik if case == "finite" else jnp.asarray(np.asarray(ik, np.float32) * 1e30, jnp.bfloat16)
        one_call, steps = jax.block_until_ready(both(keys))
        for x, y in zip(one_call, steps):
            assert x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes(), case
        if case == "finite":
            assert float(jnp.abs(steps[1].astype(jnp.float32)).max()) > 0
    assert np.isnan(np.asarray(steps[1], np.float32)).all()
