"""sparse_mla's jnp path (the CPU's path) against the float64 oracle (SPEC §8):
head and slot counts, adversarial indices, rows with no valid slot, both lse
bases, batches with per-batch q_start, packed rows and topk_length, GQA; the
chunk loop; attn_dist on sparse_mla's lse sums to 1 per head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import seed_of
from jax_attn_dist import attn_dist, oracle, sparse_mla, sparse_mla_reference
from jax_attn_dist._core import checks
from jax_attn_dist.ops.sparse_mla.reference import reference_canonical
from sparse_mla_cases import check_against_oracle, make_sparse_mla_inputs, oracle_kwargs, run

F32 = jnp.float32
BF16 = jnp.bfloat16

#: float32 inputs: float32-level errors; bf16: out is rounded once to bf16
#: (2^-8 relative), lse stays float32.
TOL = {F32: (1e-5, 1e-5), BF16: (2 ** -8, 1e-5)}


def check(q, kv, idx, kw, out, lse, dtype, **packing):
    out_tol, lse_tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == F32
    return check_against_oracle(q, kv, idx, kw, out, lse, out_tol=out_tol, lse_tol=lse_tol, **packing)


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
