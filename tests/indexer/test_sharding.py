"""indexer_kl sharded over 8 host CPU devices: B and S shardings (forward and
gradients) equal the unsharded call; S-shards' d index_k partial sums are
psum'ed; T and HI shardings fall back to gathering; Auto and Explicit mesh
axes, the GSPMD partitioner, shard_map, and the CUDA lowering's per-shard
kernel call."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from inputs import make_indexer_inputs, seed_of
from jaxpr_util import reductions
from jax_attn_dist import indexer_kl, oracle
from jax_attn_dist.ops.indexer import contract as indexer_contract
from sharding_util import collectives, partitioner

pytestmark = pytest.mark.host_devices(8)

F32 = jnp.float32


def mesh_of(shape, names, axis_type=jax.sharding.AxisType.Auto):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=jax.devices("cpu")[:n])


def inputs(tag, B=2, S=16, HI=8, DI=16, N=24, T=12):
    return make_indexer_inputs(seed_of("indexer-sharding", tag), B=B, S=S, HI=HI, DI=DI, N=N, T=T, dtype=F32,
                               q_start_index="batch" if B else None)


def run(mesh, specs, tag, *, grad=False, B=2, **shape):
    """(sharded result, unsharded result, compiled HLO) of the forward or of
    the gradients w.r.t. index_q, index_k, weights."""
    iq, ik, w, idx, tgt, kw = inputs(tag, B=B, **shape)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    rng = np.random.default_rng(seed_of("indexer-sharding-cot", tag))
    cot = jnp.asarray(rng.standard_normal(idx.shape[:-2]), F32)

    def f(a, b, c, d, e, s):
        if not grad:
            return indexer_kl(a, b, c, d, e, q_start_index=s, **kw)
        return jax.grad(lambda a, b, c: jnp.sum(cot * indexer_kl(a, b, c, d, e, q_start_index=s, **kw)),
                        argnums=(0, 1, 2))(a, b, c)

    args = (iq, ik, w, idx, tgt, qs)
    ref = jax.jit(f)(*args)
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    g = jax.jit(f, in_shardings=shardings)
    put = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    out = g(*put)
    hlo = g.lower(*put).compile().as_text()
    return out, ref, hlo, args, kw


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


# B and S of the row operands; index_k's B; q_start's B.
def row_specs(b, s, B=True):
    lead = (b,) if B else ()
    rows = lead + (s,)
    return (P(*rows), P(*lead), P(*rows), P(*rows), P(*rows), P(*lead))


CASES = {
    "S over 8": ((8,), ("sp",), row_specs(None, "sp")),
    "B over 2, S over 4": ((2, 4), ("b", "sp"), row_specs("b", "sp")),
    "B over 2": ((2, 4), ("b", "sp"), row_specs("b", None)),
    "S over 2x4": ((2, 4), ("x", "y"), row_specs(None, ("x", "y"))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_sharded_equals_unsharded_without_collectives(name):
    shape, names, specs = CASES[name]
    out, ref, hlo, args, kw = run(mesh_of(shape, names), specs, name)
    close(out, ref)
    assert not collectives(hlo), collectives(hlo)
    iq = args[0]
    assert f"f32[{','.join(map(str, iq.shape))}]" not in hlo  # index_q never exists whole


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_sharded_equal_unsharded(name):
    shape, names, specs = CASES[name]
    out, ref, hlo, args, kw = run(mesh_of(shape, names), specs, name, grad=True)
    close(out, ref)
    found = collectives(hlo)
    s_sharded = specs[0][1] is not None
    # S-shards' d index_k partial sums are all-reduced, nothing else moves
    assert found == ({"all-reduce"} if s_sharded else set()), found


def test_sharded_forward_matches_float64():
    shape, names, specs = CASES["B over 2, S over 4"]
    out, _, _, args, kw = run(mesh_of(shape, names), specs, "float64")
    want = oracle.indexer_kl_oracle(*args[:5], q_start_index=np.asarray(args[5]), **kw)
    oracle.assert_indexer_close(out, want)


def test_t_and_heads_shardings_are_gathered_and_exact():
    """T or HI sharded: gathered (the per-row softmax and head sum need them
    whole), still exact."""
    mesh = mesh_of((2, 4), ("b", "x"))
    specs = (P("b", None, "x"), P("b"), P("b", None, "x"), P("b", None, None, "x"), P("b", None, "x"), P("b"))
    out, ref, hlo, *_ = run(mesh, specs, "t-and-heads", T=16)
    close(out, ref)
    assert "all-gather" in collectives(hlo)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_device_put_and_mesh_axis_types(axis_type):
    """Shardings carried by the arrays, Auto or Explicit axes (jax.make_mesh's
    default): forward and gradients equal the unsharded ones; under Explicit
    axes the gradients keep the primals' shardings."""
    mesh = mesh_of((2, 4), ("b", "sp"), getattr(jax.sharding.AxisType, axis_type))
    iq, ik, w, idx, tgt, kw = inputs("axis-types-" + axis_type)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    put = lambda x, *s: jax.device_put(np.asarray(x), NamedSharding(mesh, P(*s)))  # noqa: E731
    args = (put(iq, "b", "sp"), put(ik, "b"), put(w, "b", "sp"), put(idx, "b", "sp"), put(tgt, "b", "sp"),
            put(qs, "b"))
    f = lambda a, b, c, d, e, s: indexer_kl(a, b, c, d, e, q_start_index=s, **kw)  # noqa: E731
    loss = lambda a, b, c, d, e, s: jnp.sum(f(a, b, c, d, e, s) ** 2)  # noqa: E731
    close(jax.jit(f)(*args), f(iq, ik, w, idx, tgt, qs))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    want = jax.grad(loss, argnums=(0, 1, 2))(iq, ik, w, idx, tgt, qs)
    close(got, want)
    if axis_type == "Explicit":
        assert got[0].sharding.spec[:2] == ("b", "sp") and got[1].sharding.spec[:1] == ("b",)


def test_legacy_gspmd_partitioner():
    with partitioner(shardy=False):
        shape, names, specs = CASES["B over 2, S over 4"]
        out, ref, hlo, *_ = run(mesh_of(shape, names), specs, "gspmd")
        close(out, ref)
        assert not collectives(hlo)
        out, ref, hlo, *_ = run(mesh_of(shape, names), specs, "gspmd-grad", grad=True)
        close(out, ref)


def test_shard_map_with_user_offsets():
    mesh = mesh_of((8,), ("sp",))
    iq, ik, w, idx, tgt, kw = inputs("shard-map", B=None, S=32)
    q0 = kw.pop("q_start_index")

    @jax.jit
    def per_shard(a, b, c, d, e):
        def body(a, b, c, d, e):
            s = q0 + jax.lax.axis_index("sp") * a.shape[0]
            return indexer_kl(a, b, c, d, e, q_start_index=s, **kw)

        return jax.shard_map(body, mesh=mesh, in_specs=(P("sp"), P(), P("sp"), P("sp"), P("sp")),
                             out_specs=P("sp"))(a, b, c, d, e)

    close(per_shard(iq, ik, w, idx, tgt), indexer_kl(iq, ik, w, idx, tgt, q_start_index=q0, **kw))


def test_cuda_lowering_of_shard_map_has_a_per_shard_kernel_call(cross_lowering):
    mesh = mesh_of((8,), ("sp",))
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    args = (spec(64, 64, 128), spec(100, 128), spec(64, 64, dt=F32), spec(64, 1, 32, dt=jnp.int32),
            spec(64, 32, dt=F32))
    f = jax.shard_map(lambda a, b, c, d, e: indexer_kl(a, b, c, d, e, q_start_index=jax.lax.axis_index("sp") * 8),
                      mesh=mesh, in_specs=(P("sp"), P(), P("sp"), P("sp"), P("sp")), out_specs=P("sp"))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(rf"stablehlo\.custom_call @{indexer_contract.FWD_FFI_TARGET}\((.*)", text)
    assert len(calls) == 1 and "tensor<1x8x64x128xbf16>" in calls[0], calls


def test_cuda_lowering_of_the_row_sharded_deterministic_backward(cross_lowering):
    """A deterministic backward with B and S sharded (sharded_fixed_point.py),
    lowered for CUDA per shard over a 2 x 2 mesh: the bound call, a max
    all-reduce of the bound over B and S, the fixed-point call (scale_rows:
    B * S of every shard), the limbs summed over S and the flag over B and
    S, and the conversion of the summed limbs with the same rows."""
    from jax_attn_dist._core import fixed_point
    from jax_attn_dist.ops.indexer.sharded_fixed_point import sharded_deterministic_backward

    mesh = mesh_of((2, 2), ("b", "s"))
    B, S, HI, DI, N, T = 2, 16, 64, 128, 40, 8
    params = dict(scale=0.5, causal=True, k_stride=1, deterministic=True, implementation=None)
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    args = (spec(B, S, HI, DI), spec(B, N, DI), spec(B, S, HI, dt=F32), spec(B, S, 1, T, dt=jnp.int32),
            spec(B, S, T, dt=F32), spec(B, dt=jnp.int32), spec(B, S, 0, dt=jnp.int32), spec(B, S, dt=F32),
            spec(B, S, dt=F32))
    rows, keys, batch = P("b", "s"), P("b"), P("b")
    f = jax.shard_map(
        lambda *ops: sharded_deterministic_backward(ops, params, bound_axes=("b", "s"), sum_axes=("s",),
                                                    scale_rows=B * S),
        mesh=mesh, in_specs=(rows, keys, rows, rows, rows, batch, rows, rows, rows), out_specs=(rows, keys, rows),
        check_vma=False)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    def calls(target):
        return re.findall(rf"stablehlo\.custom_call @{target}\((.*)", text)

    (bound,) = calls(indexer_contract.BWD_BOUND_FFI_TARGET)
    assert "tensor<1x8x64x128xbf16>" in bound and "-> tensor<1xi32>" in bound, bound
    (fixed,) = calls(indexer_contract.BWD_FIXED_FFI_TARGET)
    assert f"scale_rows = {B * S} : i64" in fixed and "tensor<3x1x5120xi32>" in fixed, fixed
    (convert,) = calls(fixed_point.LIMBS_TO_FLOAT_TARGET)
    assert f"rows = {B * S} : i64" in convert, convert
    # the bound's max and the flag's sum over B and S, the limbs' sum over S alone (within a batch shard)
    found = reductions(f, *args)
    assert found == [("pmax", ("b", "s")), ("psum", ("b", "s")), ("psum", ("s",))], found


@pytest.mark.parametrize("mesh_shape,q_spec,bound_axes,sum_axes", [
    (((2, 2), ("b", "s")), P("b", "s"), ("b", "s"), ("s",)),
    (((2,), ("s",)), P(None, "s"), ("s",), ("s",)),
    (((2,), ("b",)), P("b"), ("b",), ()),       # B alone: the one scale still spans every batch element
], ids=["B-S", "S", "B"])
def test_the_partition_decides_the_sharded_deterministic_steps(monkeypatch, mesh_shape, q_spec, bound_axes,
                                                               sum_axes):
    """IndexerBwdDecision.run (the per-shard body of the partitioned
    backward), the kernel assumed to serve: with deterministic=True and B or
    S sharded it takes the sharded steps, the bound over B and S shards, the
    limbs summed over S shards, the scale for B * S rows of all shards; with
    deterministic=False, the inner primitive."""
    from jax_attn_dist.ops.indexer import partitioning, sharded_fixed_point

    mesh = mesh_of(*mesh_shape)
    B, S, HI, DI = 4, 16, 64, 128
    taken = []
    monkeypatch.setattr(sharded_fixed_point, "kernel_serves", lambda *a: True)
    monkeypatch.setattr(sharded_fixed_point, "sharded_deterministic_backward",
                        lambda ops, params, **kw: taken.append(kw) or "steps")
    decision = partitioning.IndexerBwdDecision(mesh, [(B, S, HI, DI)], [NamedSharding(mesh, q_spec)])
    split = lambda axes: int(np.prod([mesh.shape[a] for a in axes])) if axes else 1  # noqa: E731
    local = jax.ShapeDtypeStruct((B // split(decision.b), S // split(decision.s), HI, DI), jnp.bfloat16)
    params = dict(scale=1.0, causal=True, k_stride=1, deterministic=True, implementation=None)
    assert decision.run(lambda *ops: "inner", [local], params) == "steps"
    assert taken == [dict(bound_axes=bound_axes, sum_axes=sum_axes, scale_rows=B * S)], taken
    with pytest.raises(InnerBound):
        decision.run(bind_inner, [local], dict(params, deterministic=False))


class InnerBound(Exception):
    """Raised by bind_inner: the decision bound the inner primitive."""


def bind_inner(*operands):
    raise InnerBound
