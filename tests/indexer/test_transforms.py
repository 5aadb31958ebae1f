"""jax.vmap of indexer_kl: vmapped axes fold into the batch (one bind of the
primitive), forward and gradients equal a loop; an unbatched index_k shared
by the vmapped problems (CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from inputs import make_indexer_inputs, seed_of
from jax_attn_dist import indexer_kl, indexer_kl_p
from jaxpr_util import iter_eqns

F32 = jnp.float32


def test_vmap_equals_loop_with_one_bind():
    V = 3
    sets = [make_indexer_inputs(seed_of("indexer-vmap", v), B=2, S=6, HI=4, DI=16, N=9, T=7, dtype=F32,
                                q_start_index="batch") for v in range(V)]
    stack = [jnp.stack([s[i] for s in sets]) for i in range(5)]
    qs = jnp.stack([jnp.asarray(s[5]["q_start_index"], jnp.int32) for s in sets])
    kw = {k: v for k, v in sets[0][5].items() if k != "q_start_index"}
    f = lambda a, b, c, d, e, s: indexer_kl(a, b, c, d, e, q_start_index=s, **kw)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.vmap(f))(*stack, qs)
    assert sum(e.primitive is indexer_kl_p for e in iter_eqns(jaxpr.jaxpr)) == 1
    got = np.asarray(jax.jit(jax.vmap(f))(*stack, qs))
    for v in range(V):
        np.testing.assert_allclose(got[v], np.asarray(jax.jit(f)(*(x[v] for x in stack), qs[v])), rtol=1e-6,
                                   atol=1e-6)
    # gradients under vmap (the backward primitive's batching rule)
    gv = jax.jit(jax.vmap(jax.grad(lambda a, b, c, d, e, s: f(a, b, c, d, e, s).sum(), argnums=(0, 1, 2))))(
        *stack, qs)
    one = jax.jit(jax.grad(lambda a, b, c, d, e, s: f(a, b, c, d, e, s).sum(), argnums=(0, 1, 2)))
    for v in range(V):
        gl = one(*(x[v] for x in stack), qs[v])
        for a, b in zip(gv, gl):
            np.testing.assert_allclose(a[v], b, rtol=1e-5, atol=1e-6)


def test_vmap_of_unbatched_with_shared_index_k():
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-vmap-shared"), B=3, S=5, HI=4, DI=16, N=8, T=6,
                                                  dtype=F32)
    f = lambda a, c, d, e: indexer_kl(a, ik[0], c, d, e, **kw)  # noqa: E731
    got = jax.jit(jax.vmap(f))(iq, w, idx, tgt)
    for b in range(3):
        np.testing.assert_allclose(got[b], jax.jit(f)(iq[b], w[b], idx[b], tgt[b]), rtol=1e-6, atol=1e-6)
