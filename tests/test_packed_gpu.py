"""SPEC §6 (packed sequences, per-row top-k lengths) on the CUDA kernels:
the §6 keywords become per-row ranges in XLA (packing.row_ranges) and the
SM90 kernels apply them per row, skipping the blocks past topk_length
(implementation="cuda"), against the float64 oracle's independent reading of
§6; and the kernels on raw, adversarial ranges into poisoned outputs. GPU
only (see conftest.py); the jnp path's tests are test_packed.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import indexer_cases
import kernel_cases
from indexer_cases import assert_bwd_within_bound
from inputs import INT32_MAX, INT32_MIN, make_indexer_inputs, seed_of
from jax_attn_dist import attn_dist, indexer_kl, oracle
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist._core import checks
from test_packed import CASES, attn_problem, indexer_problem, no_owner_rows, traced_call

pytestmark = pytest.mark.gpu

BF16 = jnp.bfloat16
# A kernel-sized packed case: 4 sequences of unequal length, an empty one,
# padding rows and keys, per-sequence starts, and rows with short top-k.
BIG = dict(name="big", S=512, N=560, T=192, cu_q=[0, 150, 150, 350, 500], cu_k=[0, 160, 160, 380, 540],
           q_start=[0, 7, 100, 33], topk=list(np.random.default_rng(0).integers(-5, 250, 512)))
GPU_CASES = [c for c in CASES if c["name"] in ("several", "k-stride-2", "topk-packed", "topk-alone",
                                               "rows-before-first", "bad-decreasing-q", "bad-k-past-N")] + [BIG]
IDS = [c["name"] for c in GPU_CASES]


@pytest.mark.parametrize("case", GPU_CASES, ids=IDS)
def test_attn_dist_kernel_on_packed_inputs(case):
    q, k, idx, lse, rule, pk = attn_problem(case, H=64, D=576, dtype=BF16)
    fn = functools.partial(attn_dist, implementation="cuda")
    text = jax.jit(lambda *a: fn(*a, **rule, **pk)).lower(q, k, idx, lse).as_text()
    assert attn_contract.FFI_TARGET in text
    got = np.asarray(traced_call(fn, (q, k, idx, lse), rule, pk))
    want = oracle.attn_dist_oracle(q, k, idx, lse, **rule, **pk)
    if np.abs(want).max() == 0:
        assert np.all(got == 0)
    else:
        oracle.assert_within_spec(got, want)
    for s in no_owner_rows(case):
        assert np.all(got[:, s] == 0)


@pytest.mark.parametrize("case", GPU_CASES, ids=IDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_indexer_kernels_on_packed_inputs(case, deterministic):
    iq, ik, w, idx, tgt, rule, pk = indexer_problem(case, dtype=BF16, HI=64, DI=128)
    fn = functools.partial(indexer_kl, implementation="cuda", deterministic=deterministic)
    got = np.asarray(traced_call(fn, (iq, ik, w, idx, tgt), rule, pk))
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **rule, **pk))
    for s in no_owner_rows(case):
        assert got[s] == 0.0
    g = jnp.asarray(np.random.default_rng(seed_of("packed-gpu-grad", case["name"])).standard_normal(case["S"]),
                    jnp.float32)
    grad = jax.jit(jax.grad(lambda a, b, c: jnp.sum(g * fn(a, b, c, idx, tgt, **rule, **pk)), argnums=(0, 1, 2)))
    assert indexer_contract.BWD_FFI_TARGET in grad.lower(iq, ik, w).as_text()
    got_g = grad(iq, ik, w)
    assert_bwd_within_bound(got_g, *oracle.indexer_grads_oracle(iq, ik, w, idx, tgt, g, **rule, magnitudes=True,
                                                                **pk))
    if deterministic:
        for a, b in zip(got_g, grad(iq, ik, w)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# ----------------------------------------------------------------------------
# raw row ranges: the kernels' own clamping, and the skipped blocks
# ----------------------------------------------------------------------------


def adversarial_row_ranges(rng, B, S, N, T):
    """int32 [B, S, 3] (key_begin, key_end, topk_length): ordinary ranges
    mixed with every kind of out-of-range value (negative, past N or T,
    begin > end, INT32_MIN/MAX), and lengths on block edges (0, 1, 63, 64,
    65, ...)."""
    keys = np.array([INT32_MIN, -7, -1, 0, 1, N // 2, N - 1, N, N + 1, INT32_MAX], np.int64)
    lengths = np.array([INT32_MIN, -1, 0, 1, 63, 64, 65, 127, 128, T - 1, T, T + 1, INT32_MAX], np.int64)
    begin = rng.integers(0, N, (B, S))
    end = begin + rng.integers(-3, N, (B, S))
    begin = np.where(rng.random((B, S)) < 0.3, keys[rng.integers(0, len(keys), (B, S))], begin)
    end = np.where(rng.random((B, S)) < 0.3, keys[rng.integers(0, len(keys), (B, S))], end)
    length = np.where(rng.random((B, S)) < 0.6, lengths[rng.integers(0, len(lengths), (B, S))],
                      rng.integers(0, T + 1, (B, S)))
    length[0, 0] = 0  # a row with no live block (its CTA loads nothing)
    out = np.stack([begin, end, length], axis=-1)
    return np.clip(out, INT32_MIN, INT32_MAX).astype(np.int32)


def ranges_mask(indices, ranges, N):
    """bool [B, S, 1, T]: the row-range rule of checks.ROW_RANGE_FIELDS in
    Python integers (independent of the kernels' and the jnp path's)."""
    idx = np.asarray(indices).astype(np.int64)
    r = np.asarray(ranges).astype(np.int64)
    T = idx.shape[-1]
    begin = np.clip(r[..., 0], 0, N)
    end = np.clip(r[..., 1], begin, N)
    length = np.clip(r[..., 2], 0, T)
    j = np.arange(T)
    return ((idx >= begin[:, :, None, None]) & (idx < end[:, :, None, None])
            & (j < length[:, :, None, None]))


def adversarial_indices(rng, B, S, T, N):
    idx = rng.integers(0, N, (B, S, 1, T)).astype(np.int64)
    bad = np.array([INT32_MIN, -1, N, INT32_MAX], np.int64)
    idx = np.where(rng.random(idx.shape) < 0.15, bad[rng.integers(0, 4, idx.shape)], idx)
    idx[..., 1] = idx[..., 0]  # duplicates
    return idx.astype(np.int32)


@pytest.mark.parametrize("H,D,S", [(64, 576, 48), (128, 576, 48), (130, 512, 48),
                                   (64, 576, 600), (96, 512, 600), (130, 576, 300)])
def test_attn_dist_kernel_on_raw_row_ranges(H, D, S):
    """attn_dist's kernel on adversarial row ranges (with causal=True and a
    random q_start, which the ranges replace) into a NaN-poisoned output:
    every element written, the skipped blocks 0, the rest within SPEC §3.
    H = 64 and 128 are the two head tiles (128: two groups per tile); 130
    adds a partial group in a second tile. S = 48 gives fewer CTAs than an
    H100 has SMs; 1200 give several waves, each SM going through rows with
    no live block, one block (the second consumer idle) and several (and,
    for H > 64, each CTA's L2 prefetch of its successor's rows). Both must
    give the same bits twice."""
    rng = np.random.default_rng(seed_of("raw-ranges-attn", H, D, S))
    B, N, T = 2, 300, 200
    q = jnp.asarray(rng.standard_normal((B, S, H, D)).astype(np.float32), BF16)
    k = jnp.asarray(rng.standard_normal((B, N, 1, D)).astype(np.float32), BF16)
    idx = adversarial_indices(rng, B, S, T, N)
    ranges = adversarial_row_ranges(rng, B, S, N, T)
    masked = np.where(ranges_mask(idx, ranges, N), idx, -1)
    rule = dict(sm_scale=D ** -0.5, k_stride=1, lse_base="2")
    lse = oracle.exact_lse(q, k, masked, causal=False, q_start_index=0, empty_value=0.0, **rule).astype(np.float32)
    q_start = jnp.asarray(rng.integers(-50, 50, (B,)), jnp.int32)
    call = jax.jit(functools.partial(kernel_cases.poisoned_kernel_call, causal=True, **rule))
    operands = (q, k, jnp.asarray(idx), jnp.asarray(lse), q_start, jnp.asarray(ranges))
    got = np.asarray(call(*operands))
    want = oracle.attn_dist_oracle(q, k, masked, lse, causal=False, q_start_index=0, **rule)
    assert not np.isnan(got).any()
    assert np.asarray(call(*operands)).tobytes() == got.tobytes()
    oracle.assert_within_spec(got, want)
    live = np.clip(ranges[..., 2].astype(np.int64), 0, T)
    for b, s in zip(*np.nonzero(live < T)):
        assert np.all(got[b, :, s, live[b, s]:] == 0)


@pytest.mark.parametrize("HI,DI", [(64, 128), (16, 64)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_indexer_kernels_on_raw_row_ranges(deterministic, HI, DI):
    """The indexer's forward and backward kernels on adversarial row ranges
    (causal=True and q_start replaced by them) into poisoned outputs."""
    rng = np.random.default_rng(seed_of("raw-ranges-indexer", HI, DI))
    B, S, N, T = 2, 40, 300, 200
    iq, ik, w, _, tgt, kw = make_indexer_inputs(seed_of("raw-ranges-indexer", HI, DI), B=B, S=S, HI=HI, DI=DI, N=N,
                                                T=T, dtype=BF16, zero_rows=0.1)
    idx = adversarial_indices(rng, B, S, T, N)
    ranges = adversarial_row_ranges(rng, B, S, N, T)
    masked = np.where(ranges_mask(idx, ranges, N), idx, -1)
    scale = kw["scale"]
    q_start = jnp.asarray(rng.integers(-50, 50, (B,)), jnp.int32)
    operands = (iq, ik, w, jnp.asarray(idx), tgt, q_start)
    kl, lse = jax.jit(functools.partial(indexer_cases.poisoned_kernel_call, scale=scale, causal=True, k_stride=1))(
        *operands, jnp.asarray(ranges))
    plain = dict(scale=scale, causal=False, q_start_index=0, k_stride=1)
    oracle.assert_indexer_close(np.asarray(kl), oracle.indexer_kl_oracle(iq, ik, w, masked, tgt, **plain))
    want_lse = oracle.indexer_lse_oracle(iq, ik, w, masked, **plain)
    got_lse = np.asarray(lse)
    assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=2e-3 * max(1.0, np.abs(want_lse[finite]).max()))

    g = jnp.asarray(rng.standard_normal((B, S)), jnp.float32)
    bwd = jax.jit(functools.partial(indexer_cases.poisoned_bwd_call, scale=scale, causal=True, k_stride=1,
                                    deterministic=deterministic))
    got_g = bwd(*operands, lse, g, jnp.asarray(ranges))
    d_index_q, d_weights, d_index_k = got_g
    assert_bwd_within_bound((d_index_q, d_index_k, d_weights),
                            *oracle.indexer_grads_oracle(iq, ik, w, masked, tgt, g, **plain, magnitudes=True))


def test_calls_without_row_ranges_still_run():
    """The three main FFI targets take row_ranges as an optional last operand:
    a call with the operand list of before SPEC §6 (as a jax.export blob
    from then holds) gives the same bits as one with empty ranges."""
    rng = np.random.default_rng(seed_of("no-row-ranges"))
    B, S, H, D, N, T = 1, 16, 64, 576, 200, 96
    q = jnp.asarray(rng.standard_normal((B, S, H, D)).astype(np.float32), BF16)
    k = jnp.asarray(rng.standard_normal((B, N, 1, D)).astype(np.float32), BF16)
    idx = jnp.asarray(adversarial_indices(rng, B, S, T, N))
    lse = jnp.asarray(rng.uniform(3, 6, (B, S, H)).astype(np.float32))
    qs = jnp.asarray([150], jnp.int32)
    none = checks.no_row_ranges(B, S)
    attrs = dict(sm_scale=np.float32(0.05), causal=True, k_stride=np.int32(1), lse_base_e=False)
    out = jax.ShapeDtypeStruct((B, 1, S, T), jnp.float32)
    call = jax.ffi.ffi_call(attn_contract.FFI_TARGET, out)
    old = jax.jit(lambda *a: call(*a, **attrs))(q, k, idx, lse, qs)
    new = jax.jit(lambda *a: call(*a, **attrs))(q, k, idx, lse, qs, none)
    assert np.asarray(old).tobytes() == np.asarray(new).tobytes() and np.abs(np.asarray(old)).max() > 0

    iq, ik, w, _, tgt, kw = make_indexer_inputs(seed_of("no-row-ranges-ix"), B=B, S=S, HI=64, DI=128, N=N, T=T,
                                                dtype=BF16)
    attrs = dict(scale=np.float32(kw["scale"]), causal=True, k_stride=np.int32(1))
    row = jax.ShapeDtypeStruct((B, S), jnp.float32)
    fwd = jax.ffi.ffi_call(indexer_contract.FWD_FFI_TARGET, (row, row))
    operands = (iq, ik, w.astype(jnp.float32), idx, tgt, qs)
    kl_old, lse_old = jax.jit(lambda *a: fwd(*a, **attrs))(*operands)
    kl_new, lse_new = jax.jit(lambda *a: fwd(*a, **attrs))(*operands, none)
    assert np.asarray(kl_old).tobytes() == np.asarray(kl_new).tobytes()
    assert np.asarray(lse_old).tobytes() == np.asarray(lse_new).tobytes()

    outs = (jax.ShapeDtypeStruct(iq.shape, jnp.bfloat16), jax.ShapeDtypeStruct(w.shape, jnp.float32),
            jax.ShapeDtypeStruct(ik.shape, jnp.float32), jax.ShapeDtypeStruct((0,), jnp.uint8))
    bwd = jax.ffi.ffi_call(indexer_contract.BWD_FFI_TARGET, outs)
    g = jnp.ones((B, S), jnp.float32)
    grads_old = jax.jit(lambda *a: bwd(*a, deterministic=False, **attrs))(*operands, lse_old, g)
    grads_new = jax.jit(lambda *a: bwd(*a, deterministic=False, **attrs))(*operands, lse_old, g, none)
    for a, b in zip(grads_old[:2], grads_new[:2]):  # d index_q, d weights: one writer each
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    np.testing.assert_allclose(np.asarray(grads_old[2]), np.asarray(grads_new[2]), rtol=1e-5,
                               atol=1e-6 * float(np.abs(np.asarray(grads_old[2])).max()))
