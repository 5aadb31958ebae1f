"""indexer_topk on the jnp path (any backend) against the float64 oracle
(SPEC §9): a matrix of dtypes (float8 with index_k_scale included), batch,
causal rule, k_stride and q_start kinds, topk below, at and above N; rows
with fewer valid keys than topk; exact ties; signed zeros; packed rows; the
chunk loop; empty problems."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import seed_of
from jax_attn_dist import indexer_topk
from jax_attn_dist.oracle import indexer_topk as topk_oracle
from jax_attn_dist.ops.indexer_topk.reference import indexer_topk_reference_canonical, select_topk
from jax_attn_dist._core import checks
from topk_inputs import FP8, check_selection, make_topk_inputs, oracle_logits

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def run(iq, ik, w, kw, topk, **extra):
    """indexer_topk under jit, q_start_index traced."""
    kw = dict(kw, **extra)
    qs = kw.pop("q_start_index")
    return jax.jit(lambda a, b, c, s: indexer_topk(a, b, c, topk=topk, q_start_index=s, **kw))(
        iq, ik, w, jnp.asarray(qs, jnp.int32))


_CASES = []
for n, (dtype, topk) in enumerate(itertools.product((BF16, F16, F32, FP8), (1, 7, 40))):
    B = (None, 2)[n % 2]
    _CASES.append(dict(dtype=dtype, B=B, topk=topk, causal=n % 3 != 2, k_stride=(1, 2, 3)[n % 3],
                       weights_dtype=(F32, BF16)[n % 2], q_start_index="batch" if B and n % 4 < 2 else None,
                       key_scale=n % 5 == 0))


def _cid(c):
    return "{dt}-B{B}-k{topk}-{c}-ks{k_stride}-{qs}{s}".format(
        dt=jnp.dtype(c["dtype"]).name, c="causal" if c["causal"] else "full", qs=c["q_start_index"] or "int",
        s="-kscale" if c["key_scale"] else "", **{k: c[k] for k in ("B", "topk", "k_stride")})


@pytest.mark.parametrize("case", _CASES, ids=[_cid(c) for c in _CASES])
def test_matches_float64(case):
    case = dict(case)
    seed = seed_of("topk", _cid(case))
    topk = case.pop("topk")
    iq, ik, w, kw = make_topk_inputs(seed, S=9, HI=4, DI=16, N=33, **case)
    got = run(iq, ik, w, kw, topk)
    check_selection(got, iq, ik, w, kw, topk)


def test_rows_with_fewer_valid_keys_than_topk_are_padded():
    """Causal rows before q_start's first keys: row s sees min(N, q0 + s + 1)
    keys; all of them are selected, in order, then -1."""
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-pad"), S=12, HI=3, DI=8, N=20, q_start_index=-3)
    topk = 6
    got = np.asarray(run(iq, ik, w, kw, topk))[:, 0]
    for s in range(12):
        visible = max(0, min(20, -3 + s + 1))
        if visible <= topk:
            np.testing.assert_array_equal(got[s], list(range(visible)) + [-1] * (topk - visible))
    check_selection(got[:, None], iq, ik, w, kw, topk)


def test_every_key_valid_and_topk_at_and_above_n():
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-all"), S=5, HI=4, DI=16, N=11, causal=False)
    np.testing.assert_array_equal(np.asarray(run(iq, ik, w, kw, 11))[:, 0], np.tile(np.arange(11), (5, 1)))
    got = np.asarray(run(iq, ik, w, kw, 15))[:, 0]
    np.testing.assert_array_equal(got, np.tile(list(range(11)) + [-1] * 4, (5, 1)))
    got = run(iq, ik, w, kw, 4)
    logits = check_selection(got, iq, ik, w, kw, 4)
    for s in range(5):  # random data: no tie near the cut, so the exact set
        np.testing.assert_array_equal(np.asarray(got)[s, 0], topk_oracle.exact_topk(logits[s], 4))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_exact_ties_go_to_the_smaller_key(dtype):
    """Keys that are copies of key 0 have bit-identical logits: whenever the
    cut falls among them, the smaller keys are the ones kept."""
    S, N, topk = 16, 24, 5
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-ties", dtype), S=S, HI=4, DI=16, N=N, dtype=dtype,
                                     causal=False)
    iq = jnp.abs(iq)                                     # positive dot products with positive keys
    copies = [0, 2, 3, 7, 9, 13, 14, 20]                 # the largest logits, all equal: the cut falls among them
    ik = ik.at[jnp.asarray(copies)].set(jnp.abs(ik[0]) + 1)
    w = jnp.abs(w)
    got = np.asarray(run(iq, ik, w, kw, topk))[:, 0]
    logits = check_selection(got[:, None], iq, ik, w, kw, topk)
    for s in range(S):
        np.testing.assert_array_equal(got[s], topk_oracle.exact_topk(logits[s], topk))
        assert list(got[s]) == copies[:topk], (got[s], copies)


def test_signed_zero_logits_tie():
    """Rows whose logits are all +0.0 or -0.0 (index_q 0, weights of both
    signs): all tie, so the smallest keys are kept."""
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-zeros"), S=6, HI=4, DI=16, N=12, causal=False)
    iq = jnp.zeros_like(iq)
    w = w.at[:, 0].set(-1.0)
    got = np.asarray(run(iq, ik, w, kw, 5))[:, 0]
    np.testing.assert_array_equal(got, np.tile(np.arange(5), (6, 1)))


@pytest.mark.parametrize("causal", [True, False])
def test_packed_rows(causal):
    """SPEC §6: each row only its own sequence's keys, causally relative to
    it; padding rows and rows of malformed sequences get all -1."""
    S, N, topk = 14, 20, 4
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-packed", causal), S=S, HI=4, DI=16, N=N, causal=causal,
                                     k_stride=2 if causal else 1, key_scale=True)
    cu_q = jnp.asarray([0, 3, 8, 7, 12], jnp.int32)  # sequence 2 decreases: rows 7 (claimed twice) gives -1
    cu_k = jnp.asarray([0, 6, 6, 15, 20], jnp.int32)
    qs = jnp.asarray([0, 5, 1, 9], jnp.int32)
    kw = dict(kw, q_start_index=qs)
    got = jax.jit(lambda a, b, c, s, cq, ck: indexer_topk(a, b, c, topk=topk, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                                           **dict(kw, q_start_index=s)))(iq, ik, w, qs, cu_q, cu_k)
    packing = dict(cu_seqlens_q=np.asarray(cu_q), cu_seqlens_k=np.asarray(cu_k))
    logits = check_selection(got, iq, ik, w, kw, topk, **packing)
    got = np.asarray(got)[:, 0]
    assert np.all(got[12:] == -1)            # padding rows
    assert np.all(got[3:8] == -1)            # sequence 1 has no keys
    for s in range(S):                       # every selected key in the row's own sequence
        keys = got[s][got[s] >= 0]
        assert np.all(np.isfinite(logits[s, keys]))


def test_q_start_per_batch_element_and_traced():
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-batch-qs"), B=3, S=7, HI=4, DI=16, N=30, q_start_index="batch")
    kw["q_start_index"] = jnp.asarray([-2, 5, 27], jnp.int32)
    got = run(iq, ik, w, kw, 6)
    check_selection(got, iq, ik, w, kw, 6)
    got = np.asarray(got)
    assert np.all(got[0, :2] == -1) and np.all(got[2] >= 0)


def test_chunks_equal_one_pass():
    """The chunk loop (last chunk overlapping the previous one) gives the
    one-pass result, per batch element."""
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-chunks"), B=2, S=11, HI=4, DI=16, N=25, q_start_index="batch")
    qs = jnp.asarray(kw["q_start_index"], jnp.int32)
    args = (iq, ik, w, jnp.ones((2, 25), F32), qs, checks.no_row_ranges(2, 11))
    params = dict(topk=7, scale=kw["scale"], causal=True, k_stride=1)
    ref = lambda c: jax.jit(lambda *a: indexer_topk_reference_canonical(*a, chunk=c, **params))(*args)  # noqa: E731
    whole = ref(11)
    for chunk in (1, 4):
        np.testing.assert_array_equal(ref(chunk), whole)
    check_selection(whole, iq, ik, w, kw, 7)


@pytest.mark.parametrize("shape", [dict(S=0, N=5), dict(S=4, N=0), dict(B=0, S=3, N=5)])
def test_empty_problems(shape):
    B = shape.pop("B", None)
    lead = (B,) if B is not None else ()
    iq = jnp.zeros(lead + (shape["S"], 2, 8), BF16)
    ik = jnp.zeros(lead + (shape["N"], 8), BF16)
    w = jnp.zeros(lead + (shape["S"], 2), F32)
    got = indexer_topk(iq, ik, w, topk=3)
    assert got.shape == lead + (shape["S"], 1, 3) and got.dtype == jnp.int32
    assert np.all(np.asarray(got) == -1)


def test_fp8_uses_the_fp8_values_and_key_scales():
    """float8 inputs are taken at their float8 values, times index_k_scale."""
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-fp8"), S=8, HI=4, DI=32, N=40, dtype=FP8, causal=False)
    got = run(iq, ik, w, kw, 10)
    check_selection(got, iq, ik, w, kw, 10)
    # the key scales matter: a large scale on one key puts it first in most rows
    ks = np.asarray(kw["index_k_scale"]).copy()
    ks[17] = 1e4
    got2 = np.asarray(run(iq, ik, w, dict(kw, index_k_scale=jnp.asarray(ks)), 10))
    logits = oracle_logits(iq, ik, w, dict(kw, index_k_scale=ks))
    topk_oracle.assert_topk_acceptable(got2, logits, 10)
    assert (got2[:, 0] == 17).any()


def test_selection_on_heavy_ties_signed_zeros_and_nan():
    """The selection alone, on logits drawn from a few values (+-0.0 among
    them) with random validity and a NaN: exactly the float64 rule (ties to
    the smaller key, a NaN logit below every number but still valid)."""
    rng = np.random.default_rng(seed_of("topk-select"))
    C, N = 64, 23
    logits = rng.choice(np.array([-1.0, -0.0, 0.0, 0.5, 2.0], np.float32), (C, N))
    logits[3, 5] = np.nan
    valid = rng.random((C, N)) < 0.7
    valid[3] = True
    for topk in (1, 4, 23, 30):
        got = np.asarray(jax.jit(lambda x, v: select_topk(x, v, topk))(logits, valid))
        for r in range(C):
            row = np.where(valid[r], np.nan_to_num(logits[r].astype(np.float64), nan=-1e300), -np.inf)
            np.testing.assert_array_equal(got[r], topk_oracle.exact_topk(row, topk), err_msg=f"row {r} topk {topk}")
