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

from inputs import INT32_LIMIT_STARTS, INT32_MAX, INT32_MIN, seed_of
from jax_attn_dist import indexer_topk
from jax_attn_dist.oracle import indexer_topk as topk_oracle
from jax_attn_dist.ops.indexer_topk.reference import indexer_topk_reference_canonical, select_topk
from jax_attn_dist._core import checks
from jax_attn_dist.ops.indexer_topk.autodiff import indexer_topk_canonical
from topk_inputs import (FP8, adversarial_topk_ranges, assert_row_kinds, cancellation, check_selection,
                         make_topk_inputs, negative_heads_inputs, oracle_logits, raw_range_logits, valid_counts)

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


def test_logits_dominated_by_negative_heads():
    """negative_heads_inputs (sum_h |w z| about a hundred times a row's
    largest logit, most logits exactly 0): the jnp path's float32 relu sums
    stay inside SPEC §9.3's band."""
    iq, ik, w, kw = negative_heads_inputs(seed_of("topk-negative-heads"), S=12, N=2000, HI=64, DI=128)
    logits = check_selection(run(iq, ik, w, kw, 128), iq, ik, w, kw, 128)
    assert np.median(cancellation(iq, ik, w, logits)) > 50  # the regime this test is for


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


# ----------------------------------------------------------------------------
# SPEC §9.2: q_start at the int32 limits (q_start + s + 1 - k_stride leaves
# int32); SPEC §6.3: malformed boundaries; raw row ranges
# ----------------------------------------------------------------------------

# (k_stride, topk, a fifth start): with it, rows of no key, fewer keys than
# topk and more than topk. With k_stride 2^28 the limits' rows see 7 or 8 keys
# (INT32_MAX - 5: 7 for s < 5, then 8), and 3 * 2^28 - 2 gives 2 or 3.
_LIMIT_CASES = [(1, 7, -4), (3, 5, -4), (1 << 28, 7, 3 * (1 << 28) - 2)]


@pytest.mark.parametrize("dtype", [BF16, FP8])
@pytest.mark.parametrize("k_stride,topk,extra", _LIMIT_CASES, ids=[f"ks{c[0]}" for c in _LIMIT_CASES])
def test_q_start_at_int32_limits(k_stride, topk, extra, dtype):
    """Per-batch q_start INT32_MIN, INT32_MIN + 3, INT32_MAX - 5, INT32_MAX
    (and one ordinary start), traced: every row against the float64 rule,
    its number of valid keys against the rule in Python integers."""
    B, S, N = 5, 12, 40
    q_start = INT32_LIMIT_STARTS + (extra,)
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-limits", k_stride, jnp.dtype(dtype).name), B=B, S=S, HI=4,
                                     DI=16, N=N, dtype=dtype, k_stride=k_stride, q_start_index=0)
    kw["q_start_index"] = np.asarray(q_start, np.int32)
    got = run(iq, ik, w, kw, topk)
    logits = check_selection(got, iq, ik, w, kw, topk)
    assert_row_kinds(logits, topk)
    want = [[min(N, max(0, (q0 + s + 1 - k_stride) // k_stride + 1)) for s in range(S)] for q0 in q_start]
    np.testing.assert_array_equal(valid_counts(logits), want)
    got = np.asarray(got)[:, :, 0]
    for b in range(B):
        for s in range(S):
            if want[b][s] <= topk:  # every valid key, in order, then -1
                np.testing.assert_array_equal(got[b, s], list(range(want[b][s])) + [-1] * (topk - want[b][s]))


@pytest.mark.parametrize("k_stride", [1, 3])
def test_packed_q_start_at_int32_limits(k_stride):
    """SPEC §6.2 with per-sequence q_start at the int32 limits: a query's
    position (q_start + its offset in the sequence) passes INT32_MAX."""
    S, N, topk = 16, 40, 5
    cu_q = np.asarray([0, 3, 6, 10, 13, 16], np.int32)
    cu_k = np.asarray([0, 8, 16, 24, 32, 40], np.int32)
    qs = np.asarray(INT32_LIMIT_STARTS + (3,), np.int32)
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-packed-limits", k_stride), S=S, HI=4, DI=16, N=N,
                                     k_stride=k_stride, q_start_index=0)
    kw = dict(kw, q_start_index=qs)
    got = jax.jit(lambda a, b, c, s, cq, ck: indexer_topk(a, b, c, topk=topk, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                                           **dict(kw, q_start_index=s)))(
        iq, ik, w, jnp.asarray(qs), jnp.asarray(cu_q), jnp.asarray(cu_k))
    logits = check_selection(got, iq, ik, w, kw, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_row_kinds(logits, topk)
    m = valid_counts(logits)
    assert np.all(m[:6] == 0) and np.all(m[6:13] == 8)   # INT32_MIN(+3): none; INT32_MAX(-5): the whole sequence


# SPEC §6.3 on the public API: (name, cu_seqlens_q, cu_seqlens_k, the rows of
# no sequence); S = 14, N = 20, three sequences.
_MALFORMED = [
    ("q-negative", [-2, 3, 8, 14], [0, 5, 12, 20], range(0, 3)),
    ("k-negative", [0, 3, 8, 14], [-4, 5, 12, 20], range(0, 3)),
    ("q-past-S", [0, 3, 8, 16], [0, 5, 12, 20], range(8, 14)),
    ("k-past-N", [0, 3, 8, 14], [0, 5, 12, 27], range(8, 14)),
    ("extremes", [INT32_MIN, 3, 8, INT32_MAX], [0, 5, 12, INT32_MAX], list(range(0, 3)) + list(range(8, 14))),
    ("k-extremes", [0, 3, 8, 14], [INT32_MIN, INT32_MAX, 12, 20], range(0, 8)),
    ("decreasing-k", [0, 3, 8, 14], [0, 9, 5, 20], range(3, 8)),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,cu_q,cu_k,dead", _MALFORMED, ids=[c[0] for c in _MALFORMED])
def test_malformed_boundaries(name, cu_q, cu_k, dead, causal):
    """Negative boundaries, boundaries past S or N (up to INT32_MAX) and
    decreasing ones, traced: the rows they touch get all -1, the others
    their own sequence's keys."""
    S, N, topk = 14, 20, 4
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-malformed", name, causal), S=S, HI=4, DI=16, N=N, causal=causal)
    cu_q, cu_k = np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32)
    qs = np.asarray([-1, 0, 2], np.int32)
    kw = dict(kw, q_start_index=qs)
    got = jax.jit(lambda a, b, c, s, cq, ck: indexer_topk(a, b, c, topk=topk, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                                           **dict(kw, q_start_index=s)))(
        iq, ik, w, jnp.asarray(qs), jnp.asarray(cu_q), jnp.asarray(cu_k))
    logits = check_selection(got, iq, ik, w, kw, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dead = list(dead)
    live = [s for s in range(S) if s not in dead]
    assert np.all(np.asarray(got)[dead] == -1)
    assert np.all(valid_counts(logits)[dead] == 0)
    if not causal:  # every live row sees its whole (non-empty) sequence
        assert np.all(valid_counts(logits)[live] > 0)
    assert_row_kinds(logits, topk, ("empty", "select") + (("short",) if causal else ()))


def test_raw_row_ranges():
    """The primitive on raw row ranges (SPEC §6's operand, as the packing
    pass gives it; the kernel's clamp into [0, N]): negative values, values
    past N, INT32_MIN/MAX, ends before beginnings; causal and q_start are
    replaced by the ranges, field 2 is ignored."""
    B, S, N, topk = 2, 24, 40, 6
    rng = np.random.default_rng(seed_of("topk-raw-ranges"))
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-raw-ranges"), B=B, S=S, HI=4, DI=16, N=N, key_scale=True)
    ranges = adversarial_topk_ranges(rng, B, S, N, topk)
    q_start = jnp.asarray([5, -3], jnp.int32)
    call = jax.jit(lambda *a: indexer_topk_canonical(*a, topk=topk, scale=kw["scale"], causal=True, k_stride=1,
                                                     implementation="xla"))
    got = call(iq, ik, w, kw["index_k_scale"], q_start, jnp.asarray(ranges))
    logits = raw_range_logits(iq, ik, w, kw, ranges)
    assert np.asarray(got).shape == (B, S, 1, topk)
    topk_oracle.assert_topk_acceptable(got, logits, topk)
    assert_row_kinds(logits, topk)
    np.testing.assert_array_equal(valid_counts(logits)[0, :6], [3, topk - 1, 0, N, topk, topk + 1])
