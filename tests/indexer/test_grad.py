"""Gradients of indexer_kl (custom VJP, jnp backward in both modes) against
jax.grad of a plain jnp implementation of SPEC §5 (grad_util.plain_indexer_kl)
and the float64 formulas; the target's and the integers' cotangents; the
deterministic scatter; the backward as one primitive (CPU, XLA path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grad_util import assert_grad_close, plain_indexer_kl
from inputs import make_indexer_inputs, seed_of
from jax_attn_dist import indexer_kl, oracle
from jax_attn_dist._core.chunks import sorted_segment_scatter_add
from jaxpr_util import iter_eqns

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize("dtype,B,causal,k_stride,deterministic", [
    (F32, None, True, 1, False),
    (F32, 2, True, 2, True),
    (BF16, 2, False, 1, False),
    (F16, None, True, 4, True),
])
def test_gradients_match_plain_jax_grad_and_float64(dtype, B, causal, k_stride, deterministic):
    seed = seed_of("indexer-grad", jnp.dtype(dtype).name, B, causal, k_stride, deterministic)
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed, B=B, S=11, HI=6, DI=16, N=15, T=10, dtype=dtype,
                                                  causal=causal, k_stride=k_stride,
                                                  q_start_index="batch" if B else None)
    rng = np.random.default_rng(seed)
    g = jnp.asarray(rng.standard_normal(idx.shape[:-2]), F32)

    def loss(fn, a, b, c, **extra):
        return jnp.sum(g * fn(a, b, c, idx, tgt, **kw, **extra))

    got = jax.jit(jax.grad(lambda a, b, c: loss(indexer_kl, a, b, c, deterministic=deterministic),
                           argnums=(0, 1, 2)))(iq, ik, w)
    plain = jax.jit(jax.grad(lambda a, b, c: loss(plain_indexer_kl, a, b, c), argnums=(0, 1, 2)))(
        iq.astype(F32), ik.astype(F32), w.astype(F32))
    want = oracle.indexer_grads_oracle(iq, ik, w, idx, tgt, g, **kw)
    # float32 sums of cancelling terms (softmax * tau - t): errors scale with the largest gradient
    rtol, atol_frac = (2e-5, 2e-6) if dtype == F32 else (1e-2, 1e-3)  # gradients come back in the input dtype
    for name, a, p, o, x in zip(("d_index_q", "d_index_k", "d_weights"), got, plain, want, (iq, ik, w)):
        assert a.dtype == x.dtype, name
        assert_grad_close(a, o, name + " vs float64", rtol, atol_frac)
        assert_grad_close(a, p, name + " vs jax.grad", rtol, atol_frac)


def test_target_gets_a_zero_cotangent_and_integers_none():
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-cot"), S=5, HI=4, DI=16, N=9, T=6, dtype=F32)
    d_tgt = jax.jit(jax.grad(lambda t: indexer_kl(iq, ik, w, idx, t, **kw).sum()))(tgt)
    assert np.all(np.asarray(d_tgt) == 0)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    grads = jax.jit(jax.grad(lambda i, s: indexer_kl(iq, ik, w, i, tgt, q_start_index=s, **kw).sum(),
                             argnums=(0, 1), allow_int=True))(idx, qs)
    assert all(x.dtype == jax.dtypes.float0 for x in grads)


def test_deterministic_scatter_equals_scatter_add():
    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.integers(0, 12, 300).astype(np.int32).tolist() + [12, 40], jnp.int32)  # last two dropped
    vals = jnp.asarray(rng.standard_normal((302, 5)), F32)
    acc = jnp.asarray(rng.standard_normal((12, 5)), F32)
    got = jax.jit(lambda a, k, v: sorted_segment_scatter_add(a, k, v, num_keys=12))(acc, keys, vals)
    want = acc.at[keys].add(vals, mode="drop")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_backward_is_one_partitionable_primitive():
    """The backward binds indexer_kl_bwd (no [B, S, HI, T] residual: the
    forward saves only its inputs and the per-row lse)."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-jaxpr"), S=5, HI=4, DI=16, N=9, T=6)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a: indexer_kl(a, ik, w, idx, tgt, **kw).sum()))(iq)
    names = [e.primitive.name for e in iter_eqns(jaxpr.jaxpr)]
    assert names.count("indexer_kl_bwd") == 1 and "indexer_kl" in names
    fwd_res = jax.make_jaxpr(lambda a: jax.vjp(lambda x: indexer_kl(x, ik, w, idx, tgt, **kw), a)[1])(iq)
    shapes = {tuple(v.aval.shape) for v in fwd_res.jaxpr.outvars if hasattr(v.aval, "shape")}
    assert (5, 4, 6) not in shapes and (1, 5, 4, 6) not in shapes
