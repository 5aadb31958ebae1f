"""sparse_mla's jnp path (the CPU's path) against the float64 oracle (SPEC §8):
head and slot counts, adversarial indices, rows with no valid slot, both lse
bases, batches with per-batch q_start (at the int32 limits too), packed rows
and topk_length, malformed boundaries (SPEC §6.3) and raw row ranges, GQA,
empty problems (B = 0 included); the chunk loop; attn_dist on sparse_mla's
lse sums to 1 per head. The cases for q_start at the int32 limits, malformed
boundaries and raw row ranges check the gradients against the float64 ones
too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import seed_of
from jax_attn_dist import attn_dist, oracle, sparse_mla, sparse_mla_reference
from jax_attn_dist._core import checks
from jax_attn_dist.ops.sparse_mla.reference import reference_canonical
from packed_cases import CASES as PACKED_CASES
from sparse_mla_cases import (check_against_oracle, check_grads, make_int32_limit_inputs, make_sparse_mla_inputs,
                              oracle_kwargs, packed_case_has_rows, packed_case_inputs, raw_row_ranges_forward,
                              raw_row_ranges_grads, raw_row_ranges_inputs, run)

F32 = jnp.float32
BF16 = jnp.bfloat16

#: float32 inputs: float32-level errors; bf16: out is rounded once to bf16
#: (2^-8 relative), lse stays float32.
TOL = {F32: (1e-5, 1e-5), BF16: (2 ** -8, 1e-5)}


def check(q, kv, idx, kw, out, lse, dtype, **packing):
    out_tol, lse_tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == F32
    return check_against_oracle(q, kv, idx, kw, out, lse, out_tol=out_tol, lse_tol=lse_tol, **packing)


#: float32 gradients against the float64 ones (as test_grad.py)
GRAD_TOL_F32 = 2e-5


def check_grads_f32(dq, dkv, q, kv, idx, kw, dout, dlse, **packing):
    """float32 dq and dkv within GRAD_TOL_F32 of the float64 gradients (both
    measures of spec_errors), finite, exactly 0 where no gradient reaches."""
    check_grads(q, kv, idx, kw, dout, dlse, dq, dkv, tol=GRAD_TOL_F32, max_tol=GRAD_TOL_F32, **packing)


def vjp_grads(q, kv, idx, kw, dout, dlse, **packing):
    """(out, lse, dq, dkv) of sparse_mla under jit, array keywords traced."""
    kw = dict(kw, **packing)
    arrays = {n: kw.pop(n) for n in ("q_start_index", "topk_length", "cu_seqlens_q", "cu_seqlens_k")
              if n in kw and not isinstance(kw[n], (int, type(None)))}

    def f(q, kv, i, a, dout, dlse):
        (out, lse), vjp = jax.vjp(lambda q, kv: sparse_mla(q, kv, i, **kw, **a), q, kv)
        return (out, lse) + vjp((dout, dlse))

    return jax.jit(f)(q, kv, idx, arrays, dout, dlse)


def random_cotangents(seed, out_shape, lse_shape):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(out_shape).astype(np.float32)),
            jnp.asarray(rng.standard_normal(lse_shape).astype(np.float32)))


@pytest.mark.parametrize("H,T,dtype", [(1, 1, F32), (3, 7, BF16), (65, 5, F32), (200, 3, BF16), (2, 65, F32),
                                       (1, 4097, F32)])
def test_heads_and_slots(H, T, dtype):
    S = 2 if T > 1000 else 5
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("ref", H, T), S=S, H=H, D=24, N=40, T=T, d_v=16, dtype=dtype)
    out, lse = run(q, kv, idx, kw)
    check(q, kv, idx, kw, out, lse, dtype)


@pytest.mark.parametrize("lse_base", ["2", "e"])
@pytest.mark.parametrize("causal,k_stride", [(True, 1), (True, 3), (False, 1)])
def test_batch_per_batch_q_start_and_bases(lse_base, causal, k_stride):
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("batch", lse_base, causal, k_stride), B=3, S=6, H=4, D=20,
                                            N=30, T=9, d_v=20, dtype=F32, causal=causal, k_stride=k_stride,
                                            q_start_index="batch", lse_base=lse_base, empty_rows=0.2)
    out, lse = run(q, kv, idx, kw)
    _, ref_lse = check(q, kv, idx, kw, out, lse, F32)
    assert np.isneginf(ref_lse).any() and np.isfinite(ref_lse).any()


def test_lse_bases_differ_by_log2e():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("bases"), S=4, H=2, D=8, N=12, T=6, dtype=F32)
    out2, lse2 = run(q, kv, idx, dict(kw, lse_base="2"))
    oute, lsee = run(q, kv, idx, dict(kw, lse_base="e"))
    np.testing.assert_array_equal(out2, oute)
    finite = np.isfinite(np.asarray(lsee))
    np.testing.assert_allclose(np.asarray(lse2)[finite], np.asarray(lsee)[finite] * np.log2(np.e), rtol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse2), np.isneginf(lsee))


def test_adversarial_indices_and_empty_rows():
    """INT32_MIN/MAX, -1, N, duplicates; rows whose every slot is invalid
    give out exactly 0 and lse -inf; nothing is NaN."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("adv"), B=2, S=8, H=3, D=16, N=10, T=12, d_v=8, dtype=BF16,
                                            causal=False, invalid_fraction=0.5, empty_rows=0.25)
    idx_np = np.asarray(idx)
    assert (idx_np == checks.INT32_MIN).any() and (idx_np == checks.INT32_MAX).any()
    out, lse = run(q, kv, idx, kw)
    _, ref_lse = check(q, kv, idx, kw, out, lse, BF16)
    assert np.isneginf(ref_lse).any()


def test_duplicates_count_once_per_slot():
    """A key in two slots has twice the weight of a key in one slot."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 4)), F32)
    kv = jnp.asarray(rng.standard_normal((3, 1, 4)), F32)
    idx = jnp.asarray([[[0, 0, 1]]], jnp.int32)
    out, lse = sparse_mla(q, kv, idx, sm_scale=0.5, d_v=4, causal=False, lse_base="e")
    z = 0.5 * np.asarray(kv)[:, 0] @ np.asarray(q)[0, 0]
    w = np.array([2 * np.exp(z[0]), np.exp(z[1])])
    np.testing.assert_allclose(lse[0, 0], np.log(w.sum()), rtol=1e-6)
    want = (w[0] * np.asarray(kv)[0, 0] + w[1] * np.asarray(kv)[1, 0]) / w.sum()
    np.testing.assert_allclose(out[0, 0], want, rtol=1e-5, atol=1e-6)


def test_all_invalid_and_empty_problems():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("none"), S=3, H=2, D=8, N=5, T=4, dtype=BF16)
    out, lse = sparse_mla(q, kv, jnp.full(idx.shape, -1, jnp.int32), **kw)
    assert (np.asarray(out, np.float32) == 0).all() and np.isneginf(lse).all()
    for shape_q, shape_kv, shape_i in [((0, 2, 8), (5, 1, 8), (0, 1, 4)), ((3, 2, 8), (0, 1, 8), (3, 1, 4)),
                                       ((3, 2, 8), (5, 1, 8), (3, 1, 0))]:
        out, lse = sparse_mla(jnp.zeros(shape_q, BF16), jnp.zeros(shape_kv, BF16), jnp.zeros(shape_i, jnp.int32),
                              **kw)
        assert out.shape == shape_q[:2] + (8,) and lse.shape == shape_q[:2]
        assert (np.asarray(out, np.float32) == 0).all() and np.isneginf(lse).all()


def test_empty_batch():
    """B = 0 (SPEC §8.1's empty problems): out and lse of the batched shapes
    and dtypes (no element, so 0 and -inf trivially), with the int q_start
    and a per-batch q_start of shape [0], eagerly and under jit, with
    another extent 0 besides; gradients of the inputs' shapes and dtypes."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("empty-batch"), B=0, S=3, H=2, D=8, N=5, T=4, d_v=6, dtype=BF16)
    assert q.shape == (0, 3, 2, 8) and kv.shape == (0, 5, 1, 8) and idx.shape == (0, 3, 1, 4)
    for q_start in (kw["q_start_index"], jnp.zeros((0,), jnp.int32)):
        for jit in (False, True):
            out, lse = run(q, kv, idx, dict(kw, q_start_index=q_start), jit=jit)
            assert out.shape == (0, 3, 2, 6) and out.dtype == BF16
            assert lse.shape == (0, 3, 2) and lse.dtype == F32
    dout, dlse = random_cotangents(0, (0, 3, 2, 6), (0, 3, 2))
    out, lse, dq, dkv = vjp_grads(q, kv, idx, kw, dout.astype(BF16), dlse)
    assert out.shape == (0, 3, 2, 6) and lse.shape == (0, 3, 2)
    assert dq.shape == q.shape and dq.dtype == BF16 and dkv.shape == kv.shape and dkv.dtype == BF16
    out, lse = sparse_mla(jnp.zeros((0, 0, 2, 8), BF16), kv, jnp.zeros((0, 0, 1, 4), jnp.int32), **kw)
    assert out.shape == (0, 0, 2, 6) and lse.shape == (0, 0, 2)


def test_batched_empty_extents():
    """Batched S, N or T of 0 with B > 0: out exactly 0, lse -inf."""
    kw = dict(sm_scale=0.3, d_v=8, q_start_index=jnp.asarray([1, 4], jnp.int32))
    for S, N, T in ((0, 5, 4), (3, 0, 4), (3, 5, 0)):
        out, lse = run(jnp.ones((2, S, 2, 8), BF16), jnp.ones((2, N, 1, 8), BF16), jnp.zeros((2, S, 1, T), jnp.int32),
                       kw)
        assert out.shape == (2, S, 2, 8) and lse.shape == (2, S, 2)
        assert (np.asarray(out, np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("k_stride", [1, 4])
def test_q_start_at_int32_limits(k_stride):
    """Per-batch q_start INT32_MIN, INT32_MIN + 3, INT32_MAX - 5, INT32_MAX
    (SPEC §6.2: the causal rule is exact for every int32 value): the first two
    elements see no key, the last two every key in range; out, lse and the
    gradients against the float64 oracle."""
    q, kv, idx, kw = make_int32_limit_inputs(seed_of("int32-limits", k_stride), S=9, H=3, D=16, N=12, T=7,
                                             k_stride=k_stride, d_v=16, dtype=F32, invalid_fraction=0.2)
    out, lse = run(q, kv, idx, kw)
    _, ref_lse = check(q, kv, idx, kw, out, lse, F32)
    assert np.isneginf(ref_lse[:2]).all() and np.isfinite(ref_lse[2:]).mean() > 0.5
    dout, dlse = random_cotangents(seed_of("int32-limits-cot", k_stride), out.shape, lse.shape)
    _, _, dq, dkv = vjp_grads(q, kv, idx, kw, dout, dlse)
    check_grads_f32(dq, dkv, q, kv, idx, kw, dout, dlse)
    assert np.all(np.asarray(dq)[:2] == 0) and np.all(np.asarray(dkv)[:2] == 0)


def test_q_start_at_int32_limits_packed():
    """The same starts per packed sequence (cu_seqlens), k_stride 1 and 3."""
    S, N, T = 16, 16, 6
    packing = dict(cu_seqlens_q=jnp.asarray([0, 4, 8, 12, 16], jnp.int32),
                   cu_seqlens_k=jnp.asarray([0, 4, 8, 12, 16], jnp.int32))
    starts = jnp.asarray(np.array([checks.INT32_MIN, checks.INT32_MIN + 3, checks.INT32_MAX - 5,
                                   checks.INT32_MAX], np.int64).astype(np.int32))
    for k_stride in (1, 3):
        q, kv, idx, kw = make_sparse_mla_inputs(seed_of("int32-limits-packed", k_stride), S=S, H=2, D=8, N=N, T=T,
                                                d_v=8, dtype=F32, k_stride=k_stride, indices="uniform")
        kw = dict(kw, q_start_index=starts)
        out, lse = run(q, kv, idx, dict(kw, **packing))
        _, ref_lse = check(q, kv, idx, kw, out, lse, F32, **packing)
        assert np.isneginf(ref_lse[:8]).all() and np.isfinite(ref_lse[8:]).any()


@pytest.mark.parametrize("case", PACKED_CASES, ids=[c["name"] for c in PACKED_CASES])
def test_packed_cases_and_malformed_boundaries(case):
    """SPEC §6 through sparse_mla on every packed case of packed_cases.py,
    the malformed boundaries of §6.3 included (decreasing, negative, past S
    or N, the int32 extremes): no error, the rows they touch give 0 and -inf
    with zero gradients; the rest against the float64 oracle."""
    from packed_cases import no_owner_rows

    q, kv, idx, kw, packing = packed_case_inputs(case, seed_of("packed-case", case["name"]), H=4, D=16, dtype=F32)
    out, lse = run(q, kv, idx, dict(kw, **packing))
    dout, dlse = random_cotangents(seed_of("packed-case-cot", case["name"]), out.shape, lse.shape)
    _, _, dq, dkv = vjp_grads(q, kv, idx, kw, dout, dlse, **packing)
    dead = no_owner_rows(case)
    if packed_case_has_rows(case):
        check(q, kv, idx, kw, out, lse, F32, **packing)
        check_grads_f32(dq, dkv, q, kv, idx, kw, dout, dlse, **packing)
    else:
        assert np.all(np.asarray(dkv) == 0)
    assert np.all(np.asarray(out)[dead] == 0) and np.isneginf(np.asarray(lse)[dead]).all()
    assert np.all(np.asarray(dq)[dead] == 0)


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
def test_raw_row_ranges(far):
    """The primitive's raw row ranges (the operand SPEC §6's keywords become;
    sparse_mla_canonical is the lowest level taking them): adversarial
    ranges (negative, past N or T, end < begin, int32 extremes) give the
    oracle on the indices the clamp rule leaves valid, forward and backward,
    in both modes."""
    operands, params, masked, okw = raw_row_ranges_inputs(seed_of("raw-ranges", far), B=2, S=24, H=3, D=16,
                                                          N=37 if far else 40, T=70, far=far, dtype=F32)
    q, kv = operands[:2]
    out, lse, _ = raw_row_ranges_forward(operands, params, implementation="xla")
    _, ref_lse = check(q, kv, masked, okw, out, lse, F32)
    assert np.isneginf(ref_lse).any() and np.isfinite(ref_lse).any()
    dout, dlse = random_cotangents(seed_of("raw-ranges-cot", far), out.shape, lse.shape)
    for det in (False, True):
        dq, dkv, _ = raw_row_ranges_grads(operands, params, dout, dlse, implementation="xla", deterministic=det)
        check_grads_f32(dq, dkv, q, kv, masked, okw, dout, dlse)


def test_packed_rows_and_topk_length():
    """SPEC §6 through sparse_mla: cu_seqlens with per-sequence starts and a
    padding tail, topk_length (negative, 0, inside, past T)."""
    S, N, T = 12, 14, 6
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("packed"), S=S, H=3, D=16, N=N, T=T, d_v=16, dtype=F32,
                                            indices="uniform")
    rng = np.random.default_rng(1)
    packing = dict(cu_seqlens_q=jnp.asarray([0, 4, 9, 11], jnp.int32),
                   cu_seqlens_k=jnp.asarray([0, 5, 11, 14], jnp.int32),
                   topk_length=jnp.asarray(rng.integers(-2, T + 3, (S,)), jnp.int32))
    kw = dict(kw, q_start_index=jnp.asarray([0, 2, 1], jnp.int32))
    out, lse = run(q, kv, idx, dict(kw, **packing))
    ref_out, ref_lse = check(q, kv, idx, kw, out, lse, F32, **packing)
    assert np.isneginf(ref_lse[11]).all()  # padding row
    # topk_length alone, batched
    qb, kvb, idxb, kwb = make_sparse_mla_inputs(seed_of("topk"), B=2, S=5, H=2, D=8, N=9, T=7, dtype=F32,
                                                q_start_index="batch")
    tl = jnp.asarray(rng.integers(-1, 9, (2, 5)), jnp.int32)
    out, lse = run(qb, kvb, idxb, dict(kwb, topk_length=tl))
    check(qb, kvb, idxb, kwb, out, lse, F32, topk_length=tl)


def test_gqa_kv_heads():
    """HK = 2 (the jnp path's grouped-query generalisation)."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gqa"), B=2, S=4, H=6, HK=2, D=12, N=10, T=5, d_v=6, dtype=F32)
    out, lse = run(q, kv, idx, kw)
    check(q, kv, idx, kw, out, lse, F32)


def test_chunk_loop_matches_one_chunk():
    """The row loop with overlapping last chunk gives the one-chunk result."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("chunks"), B=2, S=7, H=3, D=8, N=11, T=5, dtype=F32,
                                            q_start_index="batch")
    q_start = jnp.asarray(kw["q_start_index"])
    params = dict(sm_scale=kw["sm_scale"], causal=True, k_stride=1, lse_base="2", d_v=8)
    ranges = checks.no_row_ranges(2, 7)
    one = jax.jit(lambda *a: reference_canonical(*a, **params))(q, kv, idx, q_start, ranges)
    for chunk in (3, 5):
        got = jax.jit(lambda *a: reference_canonical(*a, chunk=chunk, **params))(q, kv, idx, q_start, ranges)
        for a, b in zip(got, one):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_public_reference_and_xla_path_agree():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("public-ref"), S=5, H=2, D=8, N=9, T=4, dtype=BF16)
    a = jax.jit(lambda q, kv, i: sparse_mla_reference(q, kv, i, **kw))(q, kv, idx)
    b = jax.jit(lambda q, kv, i: sparse_mla(q, kv, i, implementation="xla", **kw))(q, kv, idx)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("lse_base", ["2", "e"])
def test_attn_dist_on_its_lse_sums_to_one(lse_base):
    """attn_dist(q, kv, indices, lse, lse_base=<same>) sums, over each head's
    valid slots, to 1: a full group row to 64, a partial one to its heads,
    a row with no valid slot to 0 (SPEC §2.3's invariant, §8.1)."""
    H = 70
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("sum1", lse_base), B=2, S=6, H=H, D=16, N=20, T=8, dtype=F32,
                                            q_start_index="batch", lse_base=lse_base, empty_rows=0.2)
    out, lse = run(q, kv, idx, kw)
    dist = attn_dist(q, kv, idx, lse, sm_scale=kw["sm_scale"], q_start_index=kw["q_start_index"],
                     lse_base=lse_base)                                      # [B, G, S, T]
    rows = np.asarray(dist).sum(-1)                                          # [B, G, S]
    has = np.isfinite(np.asarray(lse)).all(-1)                              # [B, S]
    want = np.where(has[:, None, :], np.array([64.0, H - 64.0])[None, :, None], 0.0)
    np.testing.assert_allclose(rows, want, rtol=2e-6, atol=0)
    assert (~has).any() and has.any()
    # and the oracle agrees on the lse attn_dist was given
    _, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **oracle_kwargs(kw))
    np.testing.assert_array_equal(np.isneginf(ref_lse), np.isneginf(np.asarray(lse)))
