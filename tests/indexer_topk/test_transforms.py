"""jax.vmap and jax.jit of indexer_topk: vmapped axes fold into the batch
(one bind of the primitive) and equal a loop, q_start_index and
index_k_scale mapped too; an unbatched index_k shared by the vmapped
problems; packed rows with per-example boundaries (CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from inputs import seed_of
from jax_attn_dist import cu_seqlens_from_segment_ids, indexer_topk
from jax_attn_dist.ops.indexer_topk import indexer_topk_p
from jaxpr_util import iter_eqns
from topk_inputs import check_selection, make_topk_inputs


def test_vmap_equals_loop_with_one_bind():
    V = 3
    sets = [make_topk_inputs(seed_of("topk-vmap", v), B=2, S=6, HI=4, DI=16, N=9, q_start_index="batch",
                             key_scale=True, scale=1.0) for v in range(V)]
    iq, ik, w = (jnp.stack([s[i] for s in sets]) for i in range(3))
    qs = jnp.stack([s[3]["q_start_index"] for s in sets])
    ks = jnp.stack([s[3]["index_k_scale"] for s in sets])
    f = lambda a, b, c, s, k: indexer_topk(a, b, c, topk=4, q_start_index=s, index_k_scale=k)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.vmap(f))(iq, ik, w, qs, ks)
    assert sum(e.primitive is indexer_topk_p for e in iter_eqns(jaxpr.jaxpr)) == 1
    got = np.asarray(jax.jit(jax.vmap(f))(iq, ik, w, qs, ks))
    one = jax.jit(f)
    for v in range(V):
        np.testing.assert_array_equal(got[v], one(iq[v], ik[v], w[v], qs[v], ks[v]))
        check_selection(got[v], iq[v], ik[v], w[v], sets[v][3], 4)


def test_vmap_of_unbatched_with_shared_index_k_at_another_axis():
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-vmap-shared"), B=3, S=5, HI=4, DI=16, N=8, q_start_index=2)
    f = lambda a, c: indexer_topk(a, ik[0], c, topk=3, **kw)  # noqa: E731
    got = jax.jit(jax.vmap(f, in_axes=(1, 0), out_axes=1))(jnp.moveaxis(iq, 0, 1), w)
    for b in range(3):
        np.testing.assert_array_equal(got[:, b], jax.jit(f)(iq[b], w[b]))


def test_vmap_of_packed_rows_with_per_example_boundaries():
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-vmap-packed"), B=2, S=8, HI=4, DI=16, N=8, q_start_index=0)
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 0, 0, 0, 1, 1, 1]], jnp.int32)

    def per_example(a, b, c, s):
        cu = cu_seqlens_from_segment_ids(s, num_seqs=3)
        return indexer_topk(a, b, c, topk=3, cu_seqlens_q=cu, cu_seqlens_k=cu, scale=kw["scale"])

    got = np.asarray(jax.jit(jax.vmap(per_example))(iq, ik, w, seg))
    for b in range(2):
        cu = np.asarray(cu_seqlens_from_segment_ids(seg[b], num_seqs=3))
        check_selection(got[b], iq[b], ik[b], w[b], dict(kw, q_start_index=0), 3, cu_seqlens_q=cu, cu_seqlens_k=cu)
    np.testing.assert_array_equal(got[0, 3, 0], [3, -1, -1])  # first row of sequence 1 sees only key 3
    assert np.all(got[0, 7] == -1)                            # padding row
