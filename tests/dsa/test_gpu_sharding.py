"""dsa_attention through the CUDA kernels with S, or B, sharded over 2 GPUs
(skipped unless there are at least 2 CUDA GPUs and the compiled extension
registers the ops' kernels, see conftest.py).

Every op computes each query row from that row's inputs and the replicated
keys, so the forward's out, lse, indices and KL are one GPU's bits, with no
collective. The gradients of ``sum(out * g) + mean(kl)``: the rows' own
operands (q, index_q, weights) get one GPU's bits; the shared ones (kv,
index_k) are each shard's partial sums over its rows, all-reduced, so they
equal one GPU's up to the float32 order of that sum, and nothing is
gathered; in the deterministic mode they are one GPU's bits too (the shards
share each sum's fixed-point scale and add exact integers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dsa_cases import make_dsa_inputs, split_arrays
from inputs import require_ffi_targets, seed_of
from jax_attn_dist import dsa_attention, oracle
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from jax_attn_dist.ops.sparse_mla import contract as mla_contract
from sharding_util import collectives, gpu_mesh, partitioner, same_bits

pytestmark = pytest.mark.gpu(2)

MODERATE = dict(B=2, S=256, N=1024, H=128, D=576, d_v=512, HI=64, DI=128, topk=512, dtype=jnp.bfloat16)
OPERANDS = ("q", "kv", "index_q", "index_k", "weights")
SHARED = ("kv", "index_k")  # [B, N, ...]: replicated per batch row


@pytest.fixture(autouse=True)
def _needs_these_kernels():
    require_ffi_targets(topk_contract.FFI_TARGET, mla_contract.FFI_TARGET, mla_contract.BWD_FFI_TARGET,
                        attn_contract.FFI_TARGET, indexer_contract.FWD_FFI_TARGET, indexer_contract.BWD_FFI_TARGET)


def setup(tag, **extra):
    """The layer (per-batch q_start; the first element's first rows see no
    key), its operands, and their shardings: rows over the mesh's 2 GPUs."""
    arrays, kw = make_dsa_inputs(seed_of("dsa-gpu-sharding", tag), **MODERATE, q_start_index="batch")
    kw.update(extra)
    static, traced = split_arrays(kw)
    mesh = gpu_mesh(2)
    rows, whole = NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P())
    shardings = tuple(whole if name in SHARED else rows for name in OPERANDS)
    return (lambda *a: dsa_attention(*a, **static, **traced)), arrays, shardings, rows


def test_forward_sequence_sharded_gives_one_gpus_bits():
    layer, arrays, shardings, rows = setup("forward")
    sharded = jax.jit(layer, in_shardings=shardings, out_shardings=rows)  # every output is [B, S, ...]
    want = jax.jit(layer)(*arrays)
    got = sharded(*arrays)
    for name in ("out", "indexer_kl", "indices", "lse"):
        assert same_bits(getattr(got, name), getattr(want, name)), name
    assert float(np.asarray(want.indexer_kl).max()) > 0
    hlo = sharded.lower(*arrays).compile().as_text()
    assert not collectives(hlo), collectives(hlo)


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_forward_batch_sharded_gives_one_gpus_bits(shardy):
    """B over the 2 GPUs, each batch element's keys with its rows, with Shardy
    and with the legacy GSPMD partitioner: one GPU's bits, no collective."""
    layer, arrays, _, _ = setup("batch")
    batch = NamedSharding(gpu_mesh(2), P("x"))
    want = jax.jit(layer)(*arrays)
    with partitioner(shardy):
        sharded = jax.jit(layer, in_shardings=(batch,) * len(OPERANDS), out_shardings=batch)
        got = sharded(*arrays)
        hlo = sharded.lower(*arrays).compile().as_text()
    for name in ("out", "indexer_kl", "indices", "lse"):
        assert same_bits(getattr(got, name), getattr(want, name)), name
    assert not collectives(hlo), collectives(hlo)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_sequence_sharded(deterministic):
    layer, arrays, shardings, _ = setup(f"gradients-{deterministic}", deterministic=deterministic)
    B, S, H, d_v = (MODERATE[k] for k in ("B", "S", "H", "d_v"))
    g = jnp.asarray(np.random.default_rng(2).standard_normal((B, S, H, d_v)).astype(np.float32))

    def loss(*a):
        r = layer(*a)
        return jnp.sum(r.out.astype(jnp.float32) * g) + jnp.mean(r.indexer_kl)

    grads = jax.grad(loss, argnums=tuple(range(len(OPERANDS))))
    sharded = jax.jit(grads, in_shardings=shardings, out_shardings=shardings)
    want = jax.jit(grads)(*arrays)
    got = sharded(*arrays)
    for name, a, b in zip(OPERANDS, got, want):
        assert float(jnp.abs(b.astype(jnp.float32)).max()) > 0, name
        if name in SHARED and not deterministic:
            rel, mx = oracle.spec_errors(np.asarray(a, np.float32), np.asarray(b, np.float32))
            assert rel <= 4e-3 and mx <= 1e-2, (name, rel, mx)
        else:
            assert same_bits(a, b), name
    hlo = sharded.lower(*arrays).compile().as_text()
    assert "all-reduce" in collectives(hlo) and "all-gather" not in collectives(hlo), collectives(hlo)
    if deterministic:
        for name, a, b in zip(OPERANDS, sharded(*arrays), got):
            assert same_bits(a, b), name
