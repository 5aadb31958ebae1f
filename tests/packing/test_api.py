"""SPEC §6's API: cu_seqlens_from_segment_ids, and the keywords' input
errors (each public function names itself and the argument)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn_dist import attn_dist, cu_seqlens_from_segment_ids, indexer_kl, indexer_loss
from packed_cases import attn_problem

F32 = jnp.float32


# ----------------------------------------------------------------------------
# cu_seqlens_from_segment_ids
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("ids,num_seqs,want", [
    ([0, 0, 0, 1, 1, 2, 2, 2, 2], 3, [0, 3, 5, 9]),
    ([0, 0, 1, 1, 1, -1, -1], 2, [0, 2, 5]),                 # padding at the end
    ([0, 0, 1, 1, 1, -1, -1], 5, [0, 2, 5, 5, 5, 5]),        # more sequences than present: empty ones
    ([0, 0, 2, 2, -1], 4, [0, 2, 2, 4, 4]),                  # sequence 1 absent: empty
    ([-1, -1, -1], 2, [0, 0, 0]),                            # all padding
    ([0, 1, 2, 3], 2, [0, 1, 2]),                            # ids >= num_seqs count as padding
    ([], 3, [0, 0, 0, 0]),
    ([0, 0, 1], 0, [0]),
])
def test_cu_seqlens_from_segment_ids(ids, num_seqs, want):
    got = cu_seqlens_from_segment_ids(jnp.asarray(ids, jnp.int32), num_seqs)
    assert got.dtype == jnp.int32 and got.shape == (num_seqs + 1,)
    np.testing.assert_array_equal(got, want)
    jitted = jax.jit(cu_seqlens_from_segment_ids, static_argnums=1)(jnp.asarray(ids, jnp.int32), num_seqs)
    np.testing.assert_array_equal(jitted, want)


def test_cu_seqlens_from_segment_ids_batched_and_in_use():
    ids = jnp.asarray([[0, 0, 1, 1, 1, -1], [0, 1, 1, 1, 1, 1]], jnp.int32)
    cu = cu_seqlens_from_segment_ids(ids, 3)
    np.testing.assert_array_equal(cu, [[0, 2, 5, 5], [0, 1, 6, 6]])
    np.testing.assert_array_equal(jax.vmap(lambda r: cu_seqlens_from_segment_ids(r, 3))(ids), cu)
    # with q and k sharing the packed layout: a padding row gives 0, and
    # no row sees a key of another sequence
    S = 6
    q, k, idx, lse, rule, _ = attn_problem(dict(name="segment-use", S=S, N=S, T=S, causal=False))
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (S, 1, S))
    out = np.asarray(attn_dist(q, k, idx, lse, **dict(rule, causal=True), cu_seqlens_q=cu[0], cu_seqlens_k=cu[0]))
    seq = np.asarray(ids[0])
    allowed = (seq[:, None] == seq[None, :]) & (seq[:, None] >= 0) & (np.arange(S)[None] <= np.arange(S)[:, None])
    assert np.all(out[0][~allowed] == 0) and np.all(out[0][allowed] > 0)


@pytest.mark.parametrize("args,exc,msg", [
    ((jnp.zeros((4,), F32), 2), TypeError, "`segment_ids` must have an integer dtype"),
    ((jnp.zeros((2, 2, 2), jnp.int32), 2), ValueError, "`segment_ids` must have rank 1"),
    ((jnp.zeros((4,), jnp.int32), -1), ValueError, "`num_seqs` must be an int >= 0"),
    ((jnp.zeros((4,), jnp.int32), 2.0), TypeError, "`num_seqs` must be a Python int"),
    (([0, 1], 2), TypeError, "`segment_ids` must be an int32 array"),
])
def test_cu_seqlens_from_segment_ids_bad_inputs(args, exc, msg):
    with pytest.raises(exc, match="cu_seqlens_from_segment_ids: " + msg):
        cu_seqlens_from_segment_ids(*args)


# ----------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------


def _attn_args(batched=False):
    lead = (2,) if batched else ()
    return (jnp.zeros(lead + (5, 2, 16), F32), jnp.zeros(lead + (7, 1, 16), F32),
            jnp.zeros(lead + (5, 1, 3), jnp.int32), jnp.zeros(lead + (5, 2), F32))


CU = jnp.asarray([0, 2, 5], jnp.int32)
BAD = [
    ("only q", dict(cu_seqlens_q=CU), ValueError, "`cu_seqlens_q` was given without `cu_seqlens_k`"),
    ("only k", dict(cu_seqlens_k=CU), ValueError, "`cu_seqlens_k` was given without `cu_seqlens_q`"),
    ("cu rank", dict(cu_seqlens_q=CU[None], cu_seqlens_k=CU[None]), ValueError,
     r"`cu_seqlens_q` must have shape \[num_seqs \+ 1\]"),
    ("cu empty", dict(cu_seqlens_q=CU[:0], cu_seqlens_k=CU[:0]), ValueError,
     r"`cu_seqlens_q` must have shape \[num_seqs \+ 1\]"),
    ("cu lengths", dict(cu_seqlens_q=CU, cu_seqlens_k=CU[:2]), ValueError,
     "`cu_seqlens_q` and `cu_seqlens_k` must have the same shape"),
    ("cu dtype", dict(cu_seqlens_q=CU.astype(F32), cu_seqlens_k=CU), TypeError,
     "`cu_seqlens_q` must have an integer dtype"),
    ("cu list", dict(cu_seqlens_q=[0, 2, 5], cu_seqlens_k=CU), TypeError, "`cu_seqlens_q` must be an int32 array"),
    ("cu too wide", dict(cu_seqlens_q=np.array([0, 2**33, 5]), cu_seqlens_k=CU), ValueError,
     "`cu_seqlens_q` must fit in int32"),
    ("q_start shape", dict(cu_seqlens_q=CU, cu_seqlens_k=CU, q_start_index=jnp.zeros((3,), jnp.int32)), ValueError,
     r"with cu_seqlens, `q_start_index` must be a Python int or an array of shape \[\] or \[num_seqs\] = \[2\]"),
    ("q_start big", dict(cu_seqlens_q=CU, cu_seqlens_k=CU, q_start_index=2**31), ValueError,
     "`q_start_index` must fit in int32"),
    ("q_start float", dict(cu_seqlens_q=CU, cu_seqlens_k=CU, q_start_index=jnp.zeros((2,), F32)), TypeError,
     "`q_start_index` must have an integer dtype"),
    ("q_start per seq without cu", dict(q_start_index=jnp.zeros((2,), jnp.int32)), ValueError,
     "`q_start_index` must be a scalar"),
    ("topk shape", dict(topk_length=jnp.zeros((4,), jnp.int32)), ValueError,
     r"`topk_length` must have shape \[S\] = \[5\]"),
    ("topk dtype", dict(topk_length=jnp.zeros((5,), F32)), TypeError, "`topk_length` must have an integer dtype"),
    ("topk bool", dict(topk_length=True), TypeError, "`topk_length` must be an int32 array"),
]


@pytest.mark.parametrize("name,kw,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, kw, exc, msg):
    with pytest.raises(exc, match="attn_dist: " + msg):
        attn_dist(*_attn_args(), sm_scale=0.1, lse_base="e", **kw)
    q, k, idx, lse = _attn_args()
    iq, ik, w, tgt = q, k[:, 0], lse, jnp.zeros((5, 3), F32)
    with pytest.raises(exc, match="indexer_kl: " + msg):
        indexer_kl(iq, ik, w, idx, tgt, **kw)
    with pytest.raises(exc, match="indexer_loss: " + msg):
        indexer_loss(q, k, lse, iq, ik, w, idx, sm_scale=0.1, lse_base="e", **kw)


def test_cu_seqlens_need_unbatched_inputs():
    with pytest.raises(ValueError, match="attn_dist: `cu_seqlens_q`/`cu_seqlens_k` are accepted only with unbatched"):
        attn_dist(*_attn_args(batched=True), lse_base="2", sm_scale=0.1, cu_seqlens_q=CU, cu_seqlens_k=CU)


def test_traced_wide_cu_seqlens_rejected():
    with jax.enable_x64(True), pytest.raises(TypeError, match="a traced `cu_seqlens_q` must be int32"):
        jax.jit(lambda c: attn_dist(*_attn_args(), lse_base="2", sm_scale=0.1, cu_seqlens_q=c, cu_seqlens_k=CU))(
            CU.astype(jnp.int64))


def test_empty_problem_with_packing():
    q, k, idx, lse = (x[:0] for x in _attn_args())
    out = attn_dist(q, k, idx[:, :, :], lse, lse_base="2", sm_scale=0.1, cu_seqlens_q=CU, cu_seqlens_k=CU,
                    q_start_index=jnp.zeros((2,), jnp.int32))
    assert out.shape == (1, 0, 3)
    q, k, idx, lse = _attn_args()
    out = indexer_loss(q, k, lse, q, k[:, 0], lse, idx[..., :0], lse_base="2", sm_scale=0.1, cu_seqlens_q=CU, cu_seqlens_k=CU,
                       q_start_index=jnp.zeros((2,), jnp.int32), topk_length=jnp.zeros((5,), jnp.int32))
    assert out.shape == (5,) and np.all(np.asarray(out) == 0)
