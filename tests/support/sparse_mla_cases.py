"""Seeded sparse_mla problems and their checks against the float64 oracle
(CPU and GPU tests). Not a test file."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from inputs import INT32_LIMIT_STARTS, INT32_MAX, INT32_MIN
from jax_attn_dist import oracle, sparse_mla
from jax_attn_dist.ops.sparse_mla.contract import BWD_FFI_TARGET

#: Every kind of index that selects no key (N is added per problem).
BAD_INDICES = (INT32_MIN, INT32_MIN + 1, -7, -1, INT32_MAX - 5, INT32_MAX)


def make_sparse_mla_inputs(
    seed, *, S, H, D, N, T, B=None, HK=1, d_v=None, dtype=jnp.bfloat16, causal=True, k_stride=1,
    q_start_index=None, lse_base="2", sm_scale=None, indices="adversarial", invalid_fraction=0.3,
    empty_rows=0.0,
):
    """Random sparse_mla inputs ``(q, kv, indices, kwargs)`` (jax arrays and
    sparse_mla keyword arguments, ``d_v`` defaulting to ``min(D, 512)``).

    ``indices``: "uniform" draws every slot from [-3, N + 3); "adversarial"
    draws keys in [0, N) with duplicates (every 5th slot repeats its
    neighbour) and replaces a fraction ``invalid_fraction`` of the slots by
    INT32_MIN, -1, N, N + 1, INT32_MAX and other out-of-range values, and
    ``empty_rows`` of the rows (at least one when > 0) entirely.
    ``q_start_index``: None draws an int in [N k_stride / 2 - 2, N k_stride)
    (most keys visible, some not); "batch" an int32 [B] array of such
    values, the first -2 (its first rows see no key)."""
    rng = np.random.default_rng(seed)
    lead = (B,) if B is not None else ()
    d_v = min(D, 512) if d_v is None else d_v
    sm_scale = float(D ** -0.5 * rng.uniform(0.8, 1.6)) if sm_scale is None else sm_scale
    q = jnp.asarray(rng.standard_normal(lead + (S, H, D)).astype(np.float32), dtype)
    kv = jnp.asarray(rng.standard_normal(lead + (N, HK, D)).astype(np.float32), dtype)
    if indices == "uniform":
        idx = rng.integers(-3, N + 3, lead + (S, HK, T)).astype(np.int64)
    else:
        assert indices == "adversarial", indices
        idx = rng.integers(0, max(N, 1), lead + (S, HK, T)).astype(np.int64)
        idx[..., 1::5] = idx[..., ::5][..., : idx[..., 1::5].shape[-1]]  # duplicates
        pool = np.array(BAD_INDICES + (N, N + 1), np.int64)
        bad = pool[rng.integers(0, len(pool), idx.shape)]
        idx = np.where(rng.random(idx.shape) < invalid_fraction, bad, idx)
        if empty_rows:
            rows = rng.random(lead + (S,)) < empty_rows
            rows.reshape(-1)[0] = True
            idx = np.where(rows[..., None, None], bad, idx)
    span = max(N * k_stride, 1)
    if q_start_index is None:
        q_start_index = int(rng.integers(span // 2 - 2, span))
    elif isinstance(q_start_index, str) and q_start_index == "batch":
        starts = rng.integers(span // 2 - 2, span, (B or 1,))
        starts[0] = -2  # the first element's first rows see no key
        q_start_index = jnp.asarray(starts, jnp.int32)
    kwargs = dict(sm_scale=sm_scale, d_v=d_v, causal=causal, q_start_index=q_start_index, k_stride=k_stride,
                  lse_base=lse_base)
    return q, kv, jnp.asarray(idx.astype(np.int32)), kwargs


def oracle_kwargs(kwargs):
    """The oracle's keywords: the same, with arrays on the host."""
    out = dict(kwargs)
    for name in ("q_start_index", "topk_length", "cu_seqlens_q", "cu_seqlens_k"):
        if name in out and not isinstance(out[name], (int, type(None))):
            out[name] = np.asarray(out[name])
    out.pop("implementation", None)
    out.pop("deterministic", None)
    return out


def run(q, kv, idx, kwargs, *, jit=True, **extra):
    """sparse_mla with ``kwargs`` (+ ``extra``), under jit with every array
    keyword traced."""
    kw = dict(kwargs, **extra)
    arrays = {n: kw.pop(n) for n in ("q_start_index", "topk_length", "cu_seqlens_q", "cu_seqlens_k")
              if n in kw and not isinstance(kw[n], (int, type(None)))}
    f = lambda q, kv, i, a: sparse_mla(q, kv, i, **kw, **a)  # noqa: E731
    return (jax.jit(f) if jit else f)(q, kv, idx, arrays)


def lse_errors(lse, ref):
    """(max |lse - ref| over the finite entries, whether the -inf entries
    match exactly)."""
    lse, ref = np.asarray(lse, np.float64), np.asarray(ref, np.float64)
    empty = np.isneginf(ref)
    same_empty = bool(np.array_equal(np.isneginf(lse), empty)) and bool(np.isfinite(lse[~empty]).all())
    err = float(np.abs(lse[~empty] - ref[~empty]).max()) if (~empty).any() else 0.0
    return err, same_empty


def assert_out_and_lse(out, lse, ref_out, ref_lse, *, out_tol, lse_tol):
    """out within ``out_tol`` (SPEC §3.1's two measures) and lse within
    ``lse_tol`` (absolute) of the float64 ``ref_out``/``ref_lse``; rows with
    no valid slot exactly 0 and -inf; out finite. Returns (rel, max, lse
    error)."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert np.isfinite(out).all(), "out has non-finite values"
    assert np.abs(ref_out).max() > 0, "degenerate problem: the oracle's out is all 0"
    rel, mx = oracle.spec_errors(out, ref_out)
    assert rel <= out_tol and mx <= out_tol, f"out: rel {rel:.3e}, max {mx:.3e} (tol {out_tol:g})"
    err, same_empty = lse_errors(lse, ref_lse)
    assert same_empty, "lse: the rows with no valid slot (-inf) differ"
    assert err <= lse_tol, f"lse: max abs error {err:.3e} (tol {lse_tol:g})"
    empty = np.isneginf(ref_lse)
    assert np.all(out[empty] == 0.0), "rows with no valid slot must give out = 0 exactly"
    return rel, mx, err


def check_against_oracle(q, kv, idx, kwargs, out, lse, *, out_tol, lse_tol, **packing):
    """assert_out_and_lse against the float64 oracle of this problem; returns
    the oracle's (out, lse)."""
    ref_out, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **oracle_kwargs(kwargs), **oracle_kwargs(packing))
    assert_out_and_lse(out, lse, ref_out, ref_lse, out_tol=out_tol, lse_tol=lse_tol)
    return ref_out, ref_lse


#: SPEC §8.3: the backward kernels' dq and dkv against the float64 gradients
#: (relative Frobenius error; max-abs error relative to the largest entry).
GRAD_TOL = 5e-3
GRAD_MAX_TOL = 3e-2


def cotangents(seed, q, d_v=512):
    """dout (bf16) and dlse (f32) of out's and lse's shapes."""
    rng = np.random.default_rng(seed)
    lead = q.shape[:-1]
    dout = jnp.asarray(rng.standard_normal(lead + (d_v,)).astype(np.float32), jnp.bfloat16)
    dlse = jnp.asarray(rng.standard_normal(lead).astype(np.float32))
    return dout, dlse


def grads(q, kv, idx, kw, dout, dlse, *, deterministic=False, **packing):
    """(dq, dkv) through the kernels, under jit (array keywords traced); the
    lowered module must call the backward kernel."""
    kw = dict(kw, **packing)
    arrays = {n: kw.pop(n) for n in ("q_start_index", "topk_length", "cu_seqlens_q", "cu_seqlens_k")
              if n in kw and not isinstance(kw[n], (int, type(None)))}

    def f(q, kv, idx, arrays, dout, dlse):
        fwd = lambda q, kv: sparse_mla(q, kv, idx, implementation="cuda", deterministic=deterministic,  # noqa: E731
                                       **kw, **arrays)
        _, vjp = jax.vjp(fwd, q, kv)
        return vjp((dout, dlse))

    lowered = jax.jit(f).lower(q, kv, idx, arrays, dout, dlse)  # lowered once: checked, then compiled
    assert BWD_FFI_TARGET in lowered.as_text()
    return lowered.compile()(q, kv, idx, arrays, dout, dlse)


def assert_grad_close(name, got, ref, *, zero, tol=GRAD_TOL, max_tol=GRAD_MAX_TOL):
    """One gradient ``got`` against the float64 ``ref``: relative Frobenius
    error within ``tol`` and max-abs (of the largest entry) within
    ``max_tol``, finite, exactly 0 where ``zero`` (the entries no gradient
    reaches). Returns (rel, max)."""
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert got.shape == ref.shape, name
    assert np.isfinite(got).all(), f"{name} has non-finite values"
    assert np.abs(ref).max() > 0, f"degenerate problem: the oracle's {name} is all 0"
    rel, mx = oracle.spec_errors(got, ref)
    assert rel <= tol and mx <= max_tol, f"{name}: rel {rel:.3e}, max {mx:.3e}"
    assert np.all(got[zero] == 0), f"{name}: entries with no gradient must be exactly 0"
    return rel, mx


def check_grads(q, kv, idx, kw, dout, dlse, dq, dkv, *, tol=GRAD_TOL, max_tol=GRAD_MAX_TOL, **packing):
    """dq and dkv within (``tol``, ``max_tol``) of the float64 gradients
    (assert_grad_close), in the input dtypes; entries whose float64 gradient
    is 0 exactly 0."""
    ref_dq, ref_dkv = oracle.sparse_mla_grads_oracle(q, kv, idx, np.asarray(dout, np.float64),
                                                     np.asarray(dlse, np.float64), **oracle_kwargs(kw),
                                                     **oracle_kwargs(packing))
    assert dq.dtype == q.dtype and dkv.dtype == kv.dtype, (dq.dtype, dkv.dtype)
    for name, got, ref in (("dq", dq, ref_dq), ("dkv", dkv, ref_dkv)):
        assert_grad_close(name, got, ref, zero=ref == 0, tol=tol, max_tol=max_tol)
    return ref_dq, ref_dkv


def check_kernel_grads(q, kv, idx, kw, *, deterministic=False, seed=0, **packing):
    """Random cotangents, the kernels' (dq, dkv), checked against the oracle."""
    dout, dlse = cotangents(seed, q)
    dq, dkv = grads(q, kv, idx, kw, dout, dlse, deterministic=deterministic, **packing)
    check_grads(q, kv, idx, kw, dout, dlse, dq, dkv, **packing)
    return dq, dkv


def check_sharded_steps(seed, *, B=2, S=32, H=128, D=576, N=600, T=256):
    """The steps a row-sharded deterministic backward takes per shard
    (sharded_fixed_point.py: bound call, fixed-point call, limbs, their
    conversion), run on one GPU with no shard to reduce over: they must give
    the one call's dq and dkv bits (the same scale, the limbs exact), with
    adversarial indices and empty rows; a NaN in one element's kv makes that
    element's dkv NaN in both and leaves the other's finite."""
    from inputs import require_ffi_targets
    from jax_attn_dist._core import fixed_point
    from jax_attn_dist.ops.sparse_mla.contract import BWD_BOUND_FFI_TARGET, BWD_FIXED_FFI_TARGET
    from jax_attn_dist.ops.sparse_mla.primitive import sparse_mla_bwd_p, sparse_mla_p
    from jax_attn_dist.ops.sparse_mla.sharded_fixed_point import sharded_deterministic_backward

    require_ffi_targets(BWD_BOUND_FFI_TARGET, BWD_FIXED_FFI_TARGET, fixed_point.LIMBS_TO_FLOAT_TARGET)
    q, kv, idx, kw = make_sparse_mla_inputs(seed, B=B, S=S, H=H, D=D, N=N, T=T, q_start_index="batch",
                                            empty_rows=0.1)
    dout, dlse = cotangents(seed + 1, q)
    params = dict(sm_scale=kw["sm_scale"], causal=kw["causal"], k_stride=kw["k_stride"], lse_base=kw["lse_base"],
                  d_v=kw["d_v"], deterministic=True, implementation="cuda")
    q_start = jnp.asarray(kw["q_start_index"], jnp.int32)
    ranges = jnp.zeros((B, S, 0), jnp.int32)

    @jax.jit
    def both(q, kv):
        out, lse = sparse_mla_p.bind(q, kv, idx, q_start, ranges, **params)
        ops = (q, kv, idx, q_start, ranges, out, lse, dout.astype(jnp.bfloat16), dlse)
        return sparse_mla_bwd_p.bind(*ops, **params), sharded_deterministic_backward(ops, params, axes=(),
                                                                                     scale_rows=S)

    for case in ("finite", "nan"):
        kv_case = kv if case == "finite" else kv.at[1, 5, 0, 9].set(jnp.nan)
        one_call, steps = jax.block_until_ready(both(q, kv_case))
        for x, y in zip(one_call, steps):
            assert x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes(), case
        assert np.isfinite(np.asarray(steps[1][0])).all() and float(jnp.abs(steps[1][0]).max()) > 0, case
    assert np.isnan(np.asarray(steps[1][1])).all()


# ----------------------------------------------------------------------------
# q_start at the int32 limits, malformed packing, raw row ranges
# ----------------------------------------------------------------------------

def make_int32_limit_inputs(seed, *, S, H, D, N, T, k_stride, dtype=jnp.bfloat16, **extra):
    """make_sparse_mla_inputs with B = 4 and the per-batch q_start
    INT32_LIMIT_STARTS (explicit values pass through its ``q_start_index``);
    causal, adversarial indices. S should exceed 6, so that INT32_MAX - 5 +
    s + 1 - k_stride passes INT32_MAX for some rows."""
    starts = jnp.asarray(np.array(INT32_LIMIT_STARTS, np.int64).astype(np.int32))
    return make_sparse_mla_inputs(seed, B=len(INT32_LIMIT_STARTS), S=S, H=H, D=D, N=N, T=T, dtype=dtype,
                                  causal=True, k_stride=k_stride, q_start_index=starts, **extra)


def packed_case_inputs(case, seed, *, H, D, dtype=jnp.bfloat16, lse_base="2"):
    """``(q, kv, indices, kwargs, packing)``: an unbatched sparse_mla problem
    on one of packed_cases.CASES (SPEC §6, malformed boundaries of §6.3
    included): its S, N, T, HK, rule and per-sequence q_start, indices
    mostly inside each row's sequence, ``packing`` its §6 keywords."""
    from packed_cases import case_indices, case_q_start, packing_kwargs

    rng = np.random.default_rng(seed)
    S, N, HK = case["S"], case["N"], case.get("HK", 1)
    q = jnp.asarray(rng.standard_normal((S, H, D)).astype(np.float32), dtype)
    kv = jnp.asarray(rng.standard_normal((N, HK, D)).astype(np.float32), dtype)
    idx = case_indices(rng, case, HK)
    kwargs = dict(sm_scale=float(D ** -0.5 * rng.uniform(0.8, 1.6)), d_v=min(D, 512),
                  causal=case.get("causal", True), q_start_index=case_q_start(case),
                  k_stride=case.get("k_stride", 1), lse_base=lse_base)
    return q, kv, idx, kwargs, packing_kwargs(case)


def packed_case_has_rows(case):
    """Whether any query row of a packed case belongs to a sequence (else
    SPEC §6.3 makes every output 0 and every lse -inf)."""
    from packed_cases import no_owner_rows

    return len(no_owner_rows(case)) < case["S"]


def raw_row_ranges_inputs(seed, *, B, S, H, D, N, T, far=False, dtype=jnp.bfloat16, lse_base="2"):
    """sparse_mla on raw row ranges (SPEC §6's ``row_ranges`` operand, int32
    [B, S, 3] of the primitive: key_begin, key_end, topk_length), as
    packed_kernel_cases feeds them to attn_dist's and the indexer's kernels:
    adversarial ranges (negative, past N or T, end < begin, the int32
    extremes; ``far``: far past N and below 0) and adversarial indices,
    with causal=True and a random q_start, which the ranges replace.

    Returns ``(operands, params, masked, oracle_kw)``: ``operands`` (q, kv,
    indices, q_start, row_ranges) for ``sparse_mla_canonical``, its static
    ``params`` (no ``deterministic``/``implementation``), ``masked`` the
    indices with every slot the clamp rule excludes set to -1
    (packed_kernel_cases.ranges_mask, read independently of the kernels) and
    ``oracle_kw`` the keywords under which the float64 oracle on ``masked``
    is the expected result (no causal rule)."""
    from packed_kernel_cases import adversarial_indices, adversarial_row_ranges, ranges_mask

    rng = np.random.default_rng(seed)
    d_v = min(D, 512)
    sm_scale = float(D ** -0.5 * rng.uniform(0.8, 1.6))
    q = jnp.asarray(rng.standard_normal((B, S, H, D)).astype(np.float32), dtype)
    kv = jnp.asarray(rng.standard_normal((B, N, 1, D)).astype(np.float32), dtype)
    idx = adversarial_indices(rng, B, S, T, N, far=far)
    ranges = adversarial_row_ranges(rng, B, S, N, T, far=far)
    masked = np.where(ranges_mask(idx, ranges, N), idx, -1).astype(np.int32)
    q_start = jnp.asarray(rng.integers(-50, 50, (B,)), jnp.int32)
    params = dict(sm_scale=sm_scale, causal=True, k_stride=1, lse_base=lse_base, d_v=d_v)
    oracle_kw = dict(sm_scale=sm_scale, d_v=d_v, causal=False, q_start_index=0, k_stride=1, lse_base=lse_base)
    operands = (q, kv, jnp.asarray(idx), q_start, jnp.asarray(ranges))
    return operands, params, jnp.asarray(masked), oracle_kw


def raw_row_ranges_forward(operands, params, *, implementation):
    """``(out, lse, lowered text)`` of ``sparse_mla_canonical`` (the lowest
    level that takes raw row ranges) under jit."""
    from jax_attn_dist.ops.sparse_mla.autodiff import sparse_mla_canonical

    f = jax.jit(lambda *a: sparse_mla_canonical(*a, deterministic=False, implementation=implementation, **params))
    lowered = f.lower(*operands)
    out, lse = lowered.compile()(*operands)
    return out, lse, lowered.as_text()


def raw_row_ranges_grads(operands, params, dout, dlse, *, implementation, deterministic):
    """``(dq, dkv, lowered text)``: the vjp of ``sparse_mla_canonical`` on raw
    row ranges with respect to q and kv, under jit."""
    from jax_attn_dist.ops.sparse_mla.autodiff import sparse_mla_canonical

    def f(q, kv, idx, q_start, ranges, dout, dlse):
        fwd = lambda q, kv: sparse_mla_canonical(q, kv, idx, q_start, ranges, deterministic=deterministic,  # noqa: E731
                                                 implementation=implementation, **params)
        _, vjp = jax.vjp(fwd, q, kv)
        return vjp((dout, dlse))

    lowered = jax.jit(f).lower(*operands, dout, dlse)
    dq, dkv = lowered.compile()(*operands, dout, dlse)
    return dq, dkv, lowered.as_text()
