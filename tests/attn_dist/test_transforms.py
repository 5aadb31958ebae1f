"""jax.vmap of attn_dist: vmapped axes fold into the native batch dimension
(one bind of the primitive), and the result equals a Python loop (CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import make_inputs, seed_of
from jax_attn_dist import attn_dist, attn_dist_p
from jaxpr_util import iter_eqns

BF16, F32 = jnp.bfloat16, jnp.float32


def assert_same(got, want):
    """Bit for bit on the CPU. Elsewhere XLA may pick other algorithms for
    other batch sizes, so float32 rounding is allowed (the kernel's vmap is
    checked bit for bit in test_gpu_transforms.py)."""
    got, want = np.asarray(got), np.asarray(want)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def primitive_operand_shapes(fn, *args):
    """The operand shapes of every attn_dist_p equation in fn's jaxpr
    (searched recursively through custom_vjp, jit, scan, ... sub-jaxprs)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [tuple(tuple(v.aval.shape) for v in e.invars) for e in iter_eqns(jaxpr) if e.primitive is attn_dist_p]


def stack_inputs(seed, V, *, B=None, S=7, H=5, D=8, N=9, T=6, HK=1, dtype=BF16, **kw):
    """V independent problems stacked on a new leading axis; per-problem
    q_start_index as an int32 [V] (unbatched) or [V, B] (batched) array."""
    parts = [
        make_inputs(seed + v, B=B, S=S, H=H, D=D, N=N, T=T, HK=HK, dtype=dtype,
                    q_start_index="batch" if B else None, lse_noise=0.2, **kw)
        for v in range(V)
    ]
    q, k, idx, lse = (jnp.stack([p[j] for p in parts]) for j in range(4))
    qs = jnp.stack([jnp.asarray(p[4]["q_start_index"], jnp.int32) for p in parts])
    kw0 = {key: val for key, val in parts[0][4].items() if key != "q_start_index"}
    return q, k, idx, lse, qs, kw0


def loop(q, k, idx, lse, qs, kw):
    """One call per problem (jitted once, called V times)."""
    f = jax.jit(lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw))
    return np.stack([np.asarray(f(q[v], k[v], idx[v], lse[v], qs[v])) for v in range(q.shape[0])])


@pytest.mark.parametrize("B", [None, 2])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_vmap_all_operands_equals_loop(B, dtype):
    V = 3
    q, k, idx, lse, qs, kw = stack_inputs(seed_of("vmap-all", B, jnp.dtype(dtype).name), V, B=B, dtype=dtype)
    f = lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw)
    got = jax.jit(jax.vmap(f))(q, k, idx, lse, qs)
    assert_same(got, loop(q, k, idx, lse, qs, kw))
    shapes = primitive_operand_shapes(jax.vmap(f), q, k, idx, lse, qs)
    Bc = B or 1
    assert shapes == [((V * Bc, 7, 5, 8), (V * Bc, 9, 1, 8), (V * Bc, 7, 1, 6), (V * Bc, 7, 5), (V * Bc,),
                       (V * Bc, 7, 0))]


def test_vmap_axes_anywhere_and_unmapped_operands():
    """Mapped axes at other positions (negative too), k and q_start not
    mapped (broadcast), out_axes elsewhere; HK > 1."""
    V = 4
    q, k, idx, lse, qs, kw = stack_inputs(seed_of("vmap-axes"), V, B=2, H=6, HK=3, causal=True)
    k0, qs0 = k[0], qs[0]
    qm = jnp.moveaxis(q, 0, 2)      # [B, S, V, H, D]
    im = jnp.moveaxis(idx, 0, -1)   # [B, S, HK, T, V]
    lm = jnp.moveaxis(lse, 0, 1)    # [B, V, S, H]
    f = lambda q, i, l: attn_dist(q, k0, i, l, q_start_index=qs0, **kw)
    got = jax.vmap(f, in_axes=(2, -1, 1), out_axes=1)(qm, im, lm)  # [B, V, G, S, T]
    want = loop(q, jnp.broadcast_to(k0, k.shape), idx, lse, jnp.broadcast_to(qs0, qs.shape), kw)
    assert_same(got, np.moveaxis(want, 0, 1))
    assert len(primitive_operand_shapes(jax.vmap(f, in_axes=(2, -1, 1)), qm, im, lm)) == 1


def test_vmap_only_q_start():
    """The same problem at V different offsets: only q_start_index is mapped."""
    seed = seed_of("vmap-qstart")
    q, k, idx, lse, kw = make_inputs(seed, S=8, H=3, D=8, N=12, T=7, lse_noise=0.2)
    kw.pop("q_start_index")
    offsets = jnp.asarray(np.random.default_rng(seed).integers(-3, 12, 5), jnp.int32)
    got = jax.vmap(lambda s: attn_dist(q, k, idx, lse, q_start_index=s, **kw))(offsets)
    want = np.stack([attn_dist(q, k, idx, lse, q_start_index=int(s), **kw) for s in offsets])
    assert_same(got, want)
    assert not np.array_equal(want[0], want[-1]) or offsets[0] == offsets[-1]


def test_nested_vmap_is_one_bind():
    """vmap of vmap over unbatched inputs: one primitive on [V1 * V2, ...]."""
    V1, V2 = 2, 3
    q, k, idx, lse, qs, kw = stack_inputs(seed_of("vmap-nested"), V1 * V2, H=4, dtype=F32)
    split = lambda x: x.reshape((V1, V2) + x.shape[1:])
    args = tuple(split(x) for x in (q, k, idx, lse, qs))
    f = lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw)
    ff = jax.vmap(jax.vmap(f))
    got = jax.jit(ff)(*args)
    assert_same(np.asarray(got).reshape((V1 * V2,) + got.shape[2:]), loop(q, k, idx, lse, qs, kw))
    shapes = primitive_operand_shapes(ff, *args)
    assert len(shapes) == 1 and shapes[0][0] == (V1 * V2, 7, 4, 8)
    # the inner vmap over q only (k, indices, lse, q_start broadcast), the outer over everything
    g = jax.vmap(lambda q, k, i, l, s: jax.vmap(lambda qq: attn_dist(qq, k, i, l, q_start_index=s, **kw))(q))
    rest = tuple(x[:, 0] for x in args[1:])
    out = jax.jit(g)(args[0], *rest)
    assert len(primitive_operand_shapes(g, args[0], *rest)) == 1
    one = jax.jit(f)
    for a in range(V1):
        for b in range(V2):
            assert_same(out[a, b], one(args[0][a, b], *(x[a] for x in rest)))


def test_vmap_of_public_unbatched_inputs_under_jit_and_size_zero():
    seed = seed_of("vmap-empty")
    q, k, idx, lse, kw = make_inputs(seed, S=4, H=2, D=8, N=5, T=3)
    f = lambda q, k, i, l: attn_dist(q, k, i, l, **kw)
    empty = lambda x: jnp.zeros((0,) + x.shape, x.dtype)
    out = jax.vmap(f)(empty(q), empty(k), empty(idx), empty(lse))
    assert out.shape == (0, 1, 4, 3)
    out = jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))(jnp.stack([q, q]), k, idx, lse)
    assert_same(out[0], f(q, k, idx, lse))
    assert_same(out[1], out[0])


@pytest.mark.host_devices(8)
@pytest.mark.parametrize("spec", [("v",), (None, "v"), ("v", None, "s"), (None, None, "s")],
                         ids=["V", "B", "V-S", "S"])
def test_vmap_of_explicitly_sharded_inputs(spec):
    """vmap over inputs sharded with Explicit mesh axes (jax.make_mesh's
    default) over the vmapped axis, the batch or S: equals the loop, and the
    output keeps the sharding of V, B and S."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = jax.devices("cpu")
    mesh = jax.make_mesh((2, 4), ("v", "s"), devices=devices[:8])
    assert mesh.axis_types[0] == jax.sharding.AxisType.Explicit
    q, k, idx, lse, qs, kw = stack_inputs(seed_of("vmap-explicit", spec), 2, B=2, S=8, dtype=F32)
    put = lambda x, n=3: jax.device_put(np.asarray(x), NamedSharding(mesh, P(*spec[:n])))  # [V, B, S, ...]
    f = lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw)
    got = jax.jit(jax.vmap(f))(put(q), put(k, 2), put(idx), put(lse), put(qs, 2))  # k: S is not its axis 2
    np.testing.assert_allclose(np.asarray(got), loop(q, k, idx, lse, qs, kw), rtol=1e-5, atol=1e-7)
    want = tuple(spec) + (None,) * (5 - len(spec))
    want = (want[0], want[1], None, want[2], None)
    assert tuple(got.sharding.spec) + (None,) * (5 - len(got.sharding.spec)) == want


@pytest.mark.host_devices(8)
def test_vmap_over_a_compound_mesh_axis():
    """The vmapped axis sharded over two Explicit mesh axes at once
    (P(("v", "s"))): one output whose spec starts with a tuple must not be
    taken for several outputs (it was, and raised a TypeError)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = jax.devices("cpu")
    mesh = jax.make_mesh((2, 4), ("v", "s"), devices=devices[:8])
    q, k, idx, lse, qs, kw = stack_inputs(seed_of("vmap-compound"), 8, B=1, S=4, dtype=F32)
    put = lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, P(("v", "s"))))
    f = lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw)
    got = jax.jit(jax.vmap(f))(put(q), put(k), put(idx), put(lse), put(qs))
    np.testing.assert_allclose(np.asarray(got), loop(q, k, idx, lse, qs, kw), rtol=1e-5, atol=1e-7)
    assert tuple(got.sharding.spec)[0] == ("v", "s")
