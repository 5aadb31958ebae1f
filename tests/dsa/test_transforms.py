"""dsa_attention under vmap (folded into the batch), with packed sequences
(SPEC §6 through every op alike) and sharded over 8 host CPU devices
(conftest.py): B and S shardings, with Shardy and with the legacy GSPMD
partitioner, equal the unsharded call, forward with no collective, and
the gradients of a sharded call equal the unsharded ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dsa_cases import check_selection, composed, layer_loss, make_dsa_inputs, oracle_layer, split_arrays
from inputs import seed_of
from jax_attn_dist import dsa_attention, oracle
from sharding_util import collectives, partitioner

SMALL = dict(S=16, N=24, H=4, D=24, HI=3, DI=16, topk=8, d_v=16)


def test_vmap_equals_the_batched_call():
    arrays, kw = make_dsa_inputs(seed_of("dsa-vmap"), **SMALL, B=3, q_start_index="batch")
    static, traced = split_arrays(kw)
    batched = jax.jit(lambda a, t: dsa_attention(*a, **static, **t))(arrays, traced)
    mapped = jax.jit(jax.vmap(lambda a, s: dsa_attention(*a, **static, q_start_index=s)))(arrays,
                                                                                          traced["q_start_index"])
    np.testing.assert_array_equal(mapped.indices, batched.indices)
    for a, b in zip(mapped, batched):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_packed_sequences():
    """Three sequences and a padding row in one row of tokens; per-sequence
    starts. The selection never crosses a sequence, and the layer equals its
    float64 evaluation and the public ops composed with the same keywords."""
    arrays, kw = make_dsa_inputs(seed_of("dsa-packed"), **SMALL)
    packing = dict(cu_seqlens_q=jnp.asarray([0, 5, 11, 15], jnp.int32),
                   cu_seqlens_k=jnp.asarray([0, 6, 16, 24], jnp.int32))
    kw["q_start_index"] = jnp.asarray([1, 4, 0], jnp.int32)
    static, traced = split_arrays(dict(kw, **packing))
    r = jax.jit(lambda a, t: dsa_attention(*a, **static, **t))(arrays, traced)
    check_selection(r.indices, arrays, kw, **packing)
    idx = np.asarray(r.indices)[:, 0]
    assert (idx[15] == -1).all() and np.isneginf(np.asarray(r.lse)[15]).all()  # the padding row
    assert ((idx[5:11] == -1) | ((idx[5:11] >= 6) & (idx[5:11] < 16))).all()
    out, lse, kl, _ = oracle_layer(arrays, r.indices, kw, **packing)
    rel, mx = oracle.spec_errors(np.asarray(r.out), out)
    assert rel <= 1e-5 and mx <= 1e-5
    oracle.assert_indexer_close(r.indexer_kl, kl)
    want = jax.jit(lambda a, t: composed(*a, **static, **t))(arrays, traced)
    np.testing.assert_array_equal(r.indices, want[2])
    np.testing.assert_allclose(np.asarray(r.indexer_kl), np.asarray(want[1]), rtol=1e-6, atol=1e-7)


def make_mesh(shape, names):
    devices = np.array(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


MESHES = {  # name: (mesh shape, axis names, the spec of q's [B, S])
    "S over 8": ((8,), ("sp",), (None, "sp")),
    "B over 2, S over 4": ((2, 4), ("b", "sp"), ("b", "sp")),
}


def sharded_case(name):
    shape, names, (b, s) = MESHES[name]
    mesh = make_mesh(shape, names)
    arrays, kw = make_dsa_inputs(seed_of("dsa-shard", name), **SMALL, B=2, q_start_index="batch")
    static, traced = split_arrays(kw)
    specs = (P(b, s), P(b), P(b, s), P(b), P(b, s))  # the keys replicated within a batch element
    shardings = (tuple(NamedSharding(mesh, p) for p in specs), {"q_start_index": NamedSharding(mesh, P(b))})
    f = lambda a, t: dsa_attention(*a, **static, **t)  # noqa: E731
    with jax.default_device(jax.devices("cpu")[0]):
        want = jax.tree.map(np.asarray, jax.jit(f)(arrays, traced))
    return f, (arrays, traced), shardings, want


def check_sharded(name):
    f, args, shardings, want = sharded_case(name)
    g = jax.jit(f, in_shardings=shardings)
    got = g(*args)
    np.testing.assert_array_equal(got.indices, want.indices)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-6)
    hlo = g.lower(*args).compile().as_text()
    assert not collectives(hlo), f"unexpected collectives {collectives(hlo)}"
    q = args[0][0]
    assert f"f32[{','.join(map(str, q.shape))}]" not in hlo, "q exists whole somewhere"


@pytest.mark.host_devices(8)
@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_equals_unsharded(name):
    check_sharded(name)


@pytest.mark.host_devices(8)
def test_legacy_gspmd_partitioner():
    with partitioner(shardy=False):
        check_sharded("B over 2, S over 4")


@pytest.mark.host_devices(8)
def test_gradients_of_a_sharded_call():
    f, (arrays, traced), (shardings, _), _ = sharded_case("B over 2, S over 4")
    g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 4, 16)).astype(np.float32))
    qs = traced["q_start_index"]
    grad = layer_loss(lambda *a: f(a, {"q_start_index": qs}), g)
    with jax.default_device(jax.devices("cpu")[0]):
        want = [np.asarray(x) for x in grad(*arrays)]
    put = [jax.device_put(x, sh) for x, sh in zip(arrays, shardings)]
    got = grad(*put)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
