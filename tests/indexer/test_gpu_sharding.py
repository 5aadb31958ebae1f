"""indexer_kl with the CUDA kernels, S sharded over 2 GPUs: the forward is
bit-identical to one GPU's and the gradients equal one GPU's, with the
shards' partial d index_k all-reduced; indexer_loss (attn_dist's target,
its sums in one fixed order) is one GPU's bits too. Skipped unless there are at least 2
CUDA GPUs and the compiled extension is registered (see conftest.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from inputs import make_indexer_inputs, seed_of
from jax_attn_dist import indexer_kl, indexer_loss, synthetic
from jax_attn_dist.ops.indexer.contract import BWD_FFI_TARGET as FFI_INDEXER_BWD
from jax_attn_dist.ops.indexer.contract import BWD_FIXED_FFI_TARGET as FFI_INDEXER_BWD_FIXED
from jax_attn_dist.ops.indexer.contract import FWD_FFI_TARGET as FFI_INDEXER_FWD
from sharding_util import bits, collectives, gpu_mesh, mixed_synthetic_problem

pytestmark = pytest.mark.gpu(2)

S, N, H, T, D = 512, 4096, 128, 512, 576


@pytest.mark.parametrize("deterministic", [False, True])
def test_indexer_sequence_sharded_over_2_gpus(deterministic):
    """indexer_kl with S over 2 GPUs: the forward is bit-identical to one GPU
    (one kernel call per shard, no collective); the gradients equal one GPU's,
    with each shard's partial d index_k (from the backward kernel) summed by
    one all-reduce; deterministic=True gives one GPU's bits (the shards agree
    on one fixed-point scale and add their integer sums exactly)."""
    prob = mixed_synthetic_problem(5, S=S, N=N, H=H, T=T, D=D)
    ix = synthetic.make_indexer(prob, HI=64, DI=128, seed=5)
    idx = prob.indices
    u = jax.random.uniform(jax.random.key(5), (S, T))
    t = jnp.where(idx[:, 0, :] >= 0, u, 0.0)
    target = t / jnp.maximum(t.sum(-1, keepdims=True), 1e-30)
    kw = dict(causal=True, k_stride=1, implementation="cuda", deterministic=deterministic)
    q_start = jnp.int32(prob.q_start_index)
    f = lambda a, b, c, d, e, s: indexer_kl(a, b, c, d, e, q_start_index=s, **kw)  # noqa: E731
    args = (*ix.arrays, idx, target, q_start)
    mesh = gpu_mesh(2)
    row, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    shardings = (row, rep, row, row, row, rep)
    ref = jax.jit(f)(*args)
    sharded = jax.jit(f, in_shardings=shardings, out_shardings=row)
    out = sharded(*args)
    assert np.array_equal(bits(out), bits(ref))
    hlo = sharded.lower(*args).compile().as_text()
    assert not collectives(hlo), collectives(hlo)
    assert len(re.findall(rf'custom_call_target="{FFI_INDEXER_FWD}"', hlo)) == 1
    assert f"f32[1,{S // 2}]" in hlo and f"bf16[1,{S},64,128]" not in hlo  # per-shard rows only

    loss = lambda a, b, c, d, e, s: jnp.sum(f(a, b, c, d, e, s) ** 2)  # noqa: E731
    g_ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    g_sharded = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=shardings)
    g = g_sharded(*args)
    for a, b in zip(g, g_ref):
        if deterministic:  # one scale over every row, exact integer sums: one GPU's bits
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2,
                                   atol=1e-3 * float(jnp.abs(b.astype(jnp.float32)).max()))
    hlo = g_sharded.lower(*args).compile().as_text()
    assert re.search(r"\ball-reduce(-start)?\(", hlo) and not re.search(r"\ball-gather(-start)?\(", hlo)
    called = FFI_INDEXER_BWD_FIXED if deterministic else FFI_INDEXER_BWD
    assert len(re.findall(rf'custom_call_target="{called}"', hlo)) == 1
    if deterministic:
        for a, b in zip(g, g_sharded(*args)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_indexer_loss_sequence_sharded_gives_one_gpus_bits():
    """indexer_loss with S over 2 GPUs: each shard runs attn_dist, the
    target's two sums (in SPEC 5.4's fixed order, not an order XLA picks per
    program) and indexer_kl on its own rows, so the loss is one GPU's bits
    and needs no collective."""
    prob = mixed_synthetic_problem(6, S=S, N=N, H=H, T=T, D=D, lse_base="e")
    ix = synthetic.make_indexer(prob, HI=64, DI=128, seed=6)
    kw = dict(prob.kwargs, implementation="cuda")
    f = lambda q, k, lse, a, b, c, idx: indexer_loss(q, k, lse, a, b, c, idx, **kw)  # noqa: E731
    args = (prob.q, prob.k, prob.lse, *ix.arrays, prob.indices)
    mesh = gpu_mesh(2)
    row, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    sharded = jax.jit(f, in_shardings=(row, rep, row, row, rep, row, row), out_shardings=row)
    want, got = jax.jit(f)(*args), sharded(*args)
    assert float(jnp.abs(want).max()) > 0
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert not collectives(sharded.lower(*args).compile().as_text())


def test_indexer_batch_sharded_deterministic_gives_one_gpus_bits():
    """B over 2 GPUs, deterministic: the one fixed-point scale spans every
    batch element, so the shards first take the maximum of their bounds
    (one word) and the gradients are one GPU's bits; d index_k needs no sum
    over the shards."""
    iq, ik, w, idx, target, kw = make_indexer_inputs(seed_of("gpu-sharding-batch-det"), B=2, S=256, HI=64, DI=128,
                                                     N=2048, T=512, q_start_index="batch")
    f = lambda a, b, c: indexer_kl(a, b, c, idx, target, implementation="cuda", deterministic=True, **kw)  # noqa: E731
    loss = lambda a, b, c: jnp.sum(f(a, b, c) ** 2)  # noqa: E731
    batch = NamedSharding(gpu_mesh(2), P("x"))
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(iq, ik, w)
    sharded = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(batch, batch, batch))
    got = sharded(iq, ik, w)
    for a, b in zip(got, want):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert float(jnp.abs(want[1].astype(jnp.float32)).max()) > 0
    hlo = sharded.lower(iq, ik, w).compile().as_text()
    assert len(re.findall(rf'custom_call_target="{FFI_INDEXER_BWD_FIXED}"', hlo)) == 1
