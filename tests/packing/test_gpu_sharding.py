"""SPEC §6 on the CUDA kernels with S sharded over 2 GPUs: packed sequences
straddling the shard boundary, per-sequence starts and topk_length give the
one-GPU bits. Skipped unless there are at least 2 CUDA GPUs and the compiled
extension is registered (see conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_attn_dist import attn_dist, indexer_kl, synthetic
from sharding_util import bits, gpu_mesh, mixed_synthetic_problem

pytestmark = pytest.mark.gpu(2)

S, N, H, T, D = 512, 4096, 128, 512, 576


def test_sequence_sharded_packed_calls_bitwise():
    """SPEC §6 on the kernels, S sharded over 2 GPUs: packed sequences that
    straddle the shard boundary, per-sequence starts and topk_length. The
    per-row ranges travel with their rows, so each shard's kernel call gives
    the one-GPU bits (attn_dist, indexer_kl and its d index_q, both modes;
    d weights and d index_k, all-reduced, within rounding)."""
    prob = mixed_synthetic_problem(7, S=S, N=N, H=H, T=T, D=D)
    ix = synthetic.make_indexer(prob, HI=64, DI=128, seed=7)
    rng = np.random.default_rng(7)
    cu_q = jnp.asarray([0, 100, 300, 301, 450], jnp.int32)   # sequence 1 straddles row 256; rows >= 450 pad
    cu_k = jnp.asarray([0, 900, 2500, 2600, 4000], jnp.int32)
    starts = jnp.asarray([0, 700, 5, 1000], jnp.int32)
    length = jnp.asarray(rng.integers(-4, T + 8, S), jnp.int32)
    idx = prob.indices
    u = jax.random.uniform(jax.random.key(7), (S, T))
    target = u / u.sum(-1, keepdims=True)
    pk = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, topk_length=length, q_start_index=starts)
    mesh = gpu_mesh(2)
    row, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    f = lambda q, k, i, l, pk: attn_dist(q, k, i, l, sm_scale=prob.sm_scale, lse_base=prob.lse_base, implementation="cuda", **pk)  # noqa: E731
    ref = jax.jit(f)(*prob.arrays, pk)
    sharded = jax.jit(f, in_shardings=(row, rep, row, row, rep))
    assert np.array_equal(bits(sharded(*prob.arrays, pk)), bits(ref))
    assert np.abs(np.asarray(ref)).max() > 0 and not np.asarray(ref)[:, 450:].any()

    for deterministic in (False, True):
        g = lambda a, b, c, pk, d=deterministic: indexer_kl(a, b, c, idx, target, implementation="cuda",  # noqa: E731
                                                            deterministic=d, **pk)
        ref = jax.jit(g)(*ix.arrays, pk)
        out = jax.jit(g, in_shardings=(row, rep, row, rep))(*ix.arrays, pk)
        assert np.array_equal(bits(out), bits(ref))
        loss = lambda a, b, c, pk, g=g: jnp.sum(g(a, b, c, pk) ** 2)  # noqa: E731
        g_ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*ix.arrays, pk)
        g_sh = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(row, rep, row, rep))(*ix.arrays, pk)
        for a, b in zip(g_sh, g_ref):  # d index_q, d weights per row; d index_k an all-reduce of 2 partials
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2,
                                       atol=1e-3 * float(jnp.abs(b.astype(jnp.float32)).max()))
        assert np.asarray(g_sh[0]).tobytes() == np.asarray(g_ref[0]).tobytes()
