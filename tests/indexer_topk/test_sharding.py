"""indexer_topk sharded over 8 host CPU devices: B and S shardings equal the
unsharded call with no collective (index_k and index_k_scale replicated per
batch row; S-shards' q_start offsets); sharded keys are gathered; Explicit
mesh axes; shard_map with user offsets; the CUDA lowering's per-shard kernel
call."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from inputs import seed_of
from jax_attn_dist import indexer_topk
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from sharding_util import collectives
from topk_inputs import check_selection, make_topk_inputs

pytestmark = pytest.mark.host_devices(8)


def mesh_of(shape, names, axis_type=jax.sharding.AxisType.Auto):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=jax.devices("cpu")[:n])


def inputs(tag):
    return make_topk_inputs(seed_of("topk-sharding", tag), B=2, S=16, HI=4, DI=16, N=24, q_start_index="batch",
                            key_scale=True)


def f(a, b, c, k, s, scale):
    return indexer_topk(a, b, c, topk=5, q_start_index=s, index_k_scale=k, scale=scale)


CASES = {
    "S over 8": ((8,), ("sp",), (None, "sp"), None),
    "B over 2, S over 4": ((2, 4), ("b", "sp"), ("b", "sp"), None),
    "B over 2, keys sharded over N": ((2, 4), ("b", "x"), ("b", None), "x"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_unsharded(name):
    shape, names, (b, s), n_axis = CASES[name]
    mesh = mesh_of(shape, names)
    iq, ik, w, kw = inputs(name)
    qs, ks = kw["q_start_index"], kw["index_k_scale"]
    args = (iq, ik, w, ks, qs)
    specs = (P(b, s), P(b, n_axis), P(b, s), P(b, n_axis), P(b))
    shardings = tuple(NamedSharding(mesh, p) for p in specs)
    g = jax.jit(lambda *a: f(*a, kw["scale"]), in_shardings=shardings)
    put = [jax.device_put(a, sh) for a, sh in zip(args, shardings)]
    out = g(*put)
    np.testing.assert_array_equal(out, jax.jit(lambda *a: f(*a, kw["scale"]))(*args))
    check_selection(out, iq, ik, w, kw, 5)
    hlo = g.lower(*put).compile().as_text()
    assert collectives(hlo) == ({"all-gather"} if n_axis else set()), collectives(hlo)
    if s:
        assert f"f32[{','.join(map(str, iq.shape))}]" not in hlo  # index_q never exists whole


def test_explicit_mesh_axes():
    mesh = mesh_of((2, 4), ("b", "sp"), jax.sharding.AxisType.Explicit)
    iq, ik, w, kw = inputs("explicit")
    put = lambda x, *s: jax.device_put(np.asarray(x), NamedSharding(mesh, P(*s)))  # noqa: E731
    args = (put(iq, "b", "sp"), put(ik, "b"), put(w, "b", "sp"), put(kw["index_k_scale"], "b"),
            put(kw["q_start_index"], "b"))
    out = jax.jit(lambda *a: f(*a, kw["scale"]))(*args)
    np.testing.assert_array_equal(out, jax.jit(lambda *a: f(*a, kw["scale"]))(
        iq, ik, w, kw["index_k_scale"], kw["q_start_index"]))


def test_shard_map_with_user_offsets():
    mesh = mesh_of((8,), ("sp",))
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-shard-map"), S=32, HI=4, DI=16, N=40)
    q0 = kw.pop("q_start_index")

    @jax.jit
    def per_shard(a, b, c):
        def body(a, b, c):
            return indexer_topk(a, b, c, topk=6, q_start_index=q0 + jax.lax.axis_index("sp") * a.shape[0], **kw)

        return jax.shard_map(body, mesh=mesh, in_specs=(P("sp"), P(), P("sp")), out_specs=P("sp"))(a, b, c)

    want = jax.jit(lambda a, b, c: indexer_topk(a, b, c, topk=6, q_start_index=q0, **kw))(iq, ik, w)
    np.testing.assert_array_equal(per_shard(iq, ik, w), want)


def test_cuda_lowering_of_shard_map_has_a_per_shard_kernel_call(cross_lowering):
    mesh = mesh_of((8,), ("sp",))
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    args = (spec(64, 64, 128), spec(100, 128), spec(64, 64, dt=jnp.float32))
    g = jax.shard_map(lambda a, b, c: indexer_topk(a, b, c, topk=32, q_start_index=jax.lax.axis_index("sp") * 8),
                      mesh=mesh, in_specs=(P("sp"), P(), P("sp")), out_specs=P("sp"))
    text = jax.jit(g).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(rf"stablehlo\.custom_call @{topk_contract.FFI_TARGET}\((.*)", text)
    assert len(calls) == 1 and "tensor<1x8x64x128xbf16>" in calls[0] and "-> tensor<1x8x1x32xi32>" in calls[0], calls
