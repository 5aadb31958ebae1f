"""Sharding on 8 CPU devices (conftest.py sets --xla_force_host_platform_device_count=8).

Every supported sharding of attn_dist (B, S, T, whole 64-head groups of H) on
1-D and 2-D meshes equals the unsharded result, and the compiled program holds
no collective and only per-shard shapes; the documented fallbacks (heads split
inside a group, K or q's D sharded) gather and still give the same result.
Also: shard_map with user offsets, the legacy GSPMD partitioner, and the CUDA
lowering of a sharded call (the per-shard module holds the kernel's custom call).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_attn_dist import attn_dist
from inputs import make_inputs, seed_of
from sharding_util import COLLECTIVES, collectives

AUTO = jax.sharding.AxisType.Auto

pytestmark = pytest.mark.host_devices(8)


def make_mesh(shape, names, axis_types=None):
    devices = np.array(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape)
    types = axis_types or (AUTO,) * len(shape)
    return jax.sharding.Mesh(devices, names, axis_types=types)


def gathered_shapes(hlo: str):
    """Result shapes ``dtype[dims]`` of every all-gather in compiled HLO text."""
    return re.findall(r"(\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)


def shape_str(dtype, shape) -> str:
    return f"{jnp.dtype(dtype).name.replace('float', 'f').replace('bfloat', 'bf')}[{','.join(map(str, shape))}]"


def local_shape(shape, spec, mesh):
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for d, e in zip(shape, spec):
        axes = () if e is None else (e if isinstance(e, tuple) else (e,))
        out.append(d // int(np.prod([mesh.shape[a] for a in axes], dtype=int)))
    return tuple(out)


# ----------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------


class Case(NamedTuple):
    name: str
    mesh: Tuple[Tuple[int, ...], Tuple[str, ...]]
    q: P                      # q [B?, S, H, D]; lse takes q's first dims
    indices: P                # indices [B?, S, HK, T]
    out: Optional[P] = None   # out_shardings (None: left to propagation)
    k: P = P()
    B: Optional[int] = 4
    S: int = 64
    H: int = 64
    T: int = 16
    HK: int = 1
    causal: bool = True
    k_stride: int = 1
    q_start: object = "batch"  # "batch": traced [B]; "scalar": traced []; or a Python int
    clean: bool = True         # no collective at all, only per-shard shapes
    gathers: str = ""          # for clean=False: which operand is gathered ("q", "k")


D, N = 16, 40
X8 = ((8,), ("x",))
XY24 = ((2, 4), ("x", "y"))
XY42 = ((4, 2), ("x", "y"))

CASES = [
    # 1-D mesh of 8
    Case("1d-batch", X8, q=P("x"), indices=P("x"), B=8, out=P("x")),
    Case("1d-seq-causal-scalar-qstart", X8, q=P(None, "x"), indices=P(None, "x"), q_start="scalar", out=P(None, None, "x")),
    Case("1d-seq-causal-per-batch-qstart", X8, q=P(None, "x"), indices=P(None, "x")),
    Case("1d-seq-kstride3", X8, q=P(None, "x"), indices=P(None, "x"), k_stride=3),
    Case("1d-seq-python-int-qstart", X8, q=P(None, "x"), indices=P(None, "x"), q_start=-9),
    Case("1d-seq-unbatched", X8, q=P("x"), indices=P("x"), B=None, q_start="scalar", out=P(None, "x")),
    Case("1d-seq-noncausal", X8, q=P(None, "x"), indices=P(None, "x"), causal=False),
    Case("1d-topk", X8, q=P(), indices=P(None, None, None, "x"), T=32, out=P(None, None, None, "x")),
    Case("1d-heads-8-groups", X8, q=P(None, None, "x"), indices=P(), H=512, S=8, B=2, out=P(None, "x")),
    Case("1d-batch-seq-topk-no-out-spec", X8, q=P(None, "x"), indices=P(None, "x"), T=24),
    # 2-D meshes
    Case("2x4-batch-seq", XY24, q=P("x", "y"), indices=P("x", "y"), out=P("x", None, "y")),
    Case("2x4-heads-2-groups-seq", XY24, q=P(None, "y", "x"), indices=P(None, "y"), H=128, out=P(None, "x", "y")),
    Case("2x4-heads-2-groups-topk", XY24, q=P(None, None, "x"), indices=P(None, None, None, "y"), H=128,
         out=P(None, "x", None, "y")),
    Case("2x4-seq-over-both-axes", XY24, q=P(None, ("x", "y")), indices=P(None, ("x", "y")),
         out=P(None, None, ("x", "y"))),
    Case("2x4-seq-over-both-axes-reversed", XY24, q=P(None, ("y", "x")), indices=P(None, ("y", "x"))),
    Case("4x2-seq-topk", XY42, q=P(None, "x"), indices=P(None, "x", None, "y"), T=32, out=P(None, None, "x", "y")),
    Case("4x2-batch-heads-seq", XY42, q=P("y", "x", None), indices=P("y", "x"), H=128, k_stride=2),
    # fallbacks (documented): they gather, and give the same result
    Case("2x4-heads-inside-group", XY24, q=P(None, "x", "y"), indices=P(None, "x"), H=128,
         clean=False, gathers="q"),
    Case("1d-heads-not-multiple-of-64", X8, q=P(None, None, "x"), indices=P(), H=96, clean=False, gathers="q"),
    Case("1d-heads-gqa-hk2", X8, q=P(None, None, "x"), indices=P(), H=128, HK=2, clean=False, gathers="q"),
    Case("1d-k-sharded-over-N", X8, q=P(None, "x"), indices=P(None, "x"), k=P(None, "x"), clean=False, gathers="k"),
    Case("2x4-k-sharded-over-D", XY24, q=P(None, "x"), indices=P(None, "x"), k=P("y", None, None, None),
         clean=False, gathers="k"),
]


def case_inputs(c: Case):
    if c.q_start == "batch":
        q_start = jnp.asarray(np.arange(c.B) * 5 - 4, jnp.int32)  # causal edge inside S
    elif c.q_start == "scalar":
        q_start = jnp.int32(-11)
    else:
        q_start = c.q_start
    q, k, idx, lse, kw = make_inputs(
        seed_of(c.name), S=c.S, H=c.H, D=D, N=N, T=c.T, B=c.B, HK=c.HK, dtype=jnp.float32,
        causal=c.causal, k_stride=c.k_stride, q_start_index=q_start,
    )
    del kw["q_start_index"]
    # Host arrays: jit places them (CPU devices, also on a GPU machine).
    q, k, idx, lse = (np.asarray(x) for x in (q, k, idx, lse))
    if not isinstance(q_start, int):
        q_start = np.asarray(q_start)
    return (q, k, idx, lse), q_start, kw


def unsharded(f, *args):
    """The reference: the same function, unsharded, on one CPU device."""
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(jax.jit(f)(*args))


def _sharded_fn(kw, python_q_start=None):
    if python_q_start is not None:
        return lambda q, k, i, l: attn_dist(q, k, i, l, q_start_index=python_q_start, **kw)
    return lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw)


def _in_specs(c: Case, lse_rank: int):
    lse_spec = P(*tuple(c.q)[:lse_rank])
    return (c.q, c.k, c.indices, lse_spec)


def run_case(c: Case):
    """(unsharded out, sharded out, compiled sharded HLO, mesh)."""
    mesh = make_mesh(*c.mesh)
    arrays, q_start, kw = case_inputs(c)
    python_q_start = q_start if isinstance(q_start, int) else None
    f = _sharded_fn(kw, python_q_start)
    args = arrays if python_q_start is not None else arrays + (q_start,)
    ref = unsharded(f, *args)
    specs = _in_specs(c, arrays[3].ndim) + (() if python_q_start is not None else (P(),))
    in_sh = tuple(NamedSharding(mesh, s) for s in specs)
    jit_kw = dict(in_shardings=in_sh)
    if c.out is not None:
        jit_kw["out_shardings"] = NamedSharding(mesh, c.out)
    g = jax.jit(f, **jit_kw)
    out = g(*args)
    hlo = g.lower(*args).compile().as_text()
    return np.asarray(ref), out, hlo, mesh, arrays


def assert_same(out, ref):
    out = np.asarray(out)
    assert out.shape == ref.shape
    # sanity: the case is not trivial (some mass, some masked slots)
    assert (ref > 0).any() and (ref == 0).any()
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sharded_equals_unsharded(case):
    ref, out, hlo, mesh, arrays = run_case(case)
    assert_same(out, ref)
    q = arrays[0]
    q_global = shape_str(q.dtype, q.shape)
    if case.clean:
        assert not collectives(hlo), f"unexpected collectives {collectives(hlo)}"
        # per-shard work only: q never exists whole, and the per-shard output
        # (the per-shard custom call / reference result) has local shape.
        q_local = local_shape(q.shape, case.q, mesh)
        assert shape_str(q.dtype, q_local) in hlo
        if q_local != q.shape:
            assert q_global not in hlo
        if case.out is not None:
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, case.out), out.ndim)
            out_local = shape_str(jnp.float32, local_shape(ref.shape, case.out, mesh))
            assert out_local in hlo
    else:
        assert "all-reduce" not in hlo
        gathered = gathered_shapes(hlo)
        k = arrays[1]
        if case.gathers == "k":
            # K is all-gathered (it must be whole on every shard); q is not.
            assert gathered and all(s == shape_str(k.dtype, k.shape) for s in gathered), gathered
            assert q_global not in hlo
        else:
            # Heads that cannot be split in whole groups: q (and lse) gathered over H.
            assert gathered, "expected heads to be gathered"


def test_sharded_causal_matches_oracle_with_offsets():
    """Anchors the comparison in the float64 oracle (not only in the
    unsharded call): S over 8 shards, per-batch q_start, k_stride 2."""
    from jax_attn_dist import oracle

    c = Case("oracle", X8, q=P(None, "x"), indices=P(None, "x"), k_stride=2)
    ref, out, hlo, mesh, arrays = run_case(c)
    _, q_start, kw = case_inputs(c)
    want = oracle.attn_dist_oracle(*arrays, q_start_index=np.asarray(q_start), **kw)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)


def test_device_put_then_jit_and_explicit_mesh():
    """Shardings carried by the arrays (device_put), no in_shardings; on the
    default (Explicit-axes) mesh of jax.make_mesh."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices("cpu")[:8])
    c = Case("dp", XY24, q=P("x", "y"), indices=P("x", "y"))
    arrays, q_start, kw = case_inputs(c)
    f = _sharded_fn(kw)
    ref = unsharded(f, *arrays, q_start)
    put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, _in_specs(c, 3))]
    g = jax.jit(f)
    out = g(*put, q_start)
    assert_same(out, ref)
    assert not collectives(g.lower(*put, q_start).compile().as_text())


def test_pjit_style_partition_specs_under_mesh():
    """pjit style: jax.jit with bare PartitionSpecs under a mesh context."""
    mesh = make_mesh(*XY24)
    c = Case("pjit", XY24, q=P("x", "y"), indices=P("x", "y"))
    arrays, q_start, kw = case_inputs(c)
    f = _sharded_fn(kw)
    ref = unsharded(f, *arrays, q_start)
    with jax.set_mesh(mesh):
        g = jax.jit(f, in_shardings=_in_specs(c, 3) + (P(),), out_shardings=P("x", None, "y"))
        out = g(*arrays, q_start)
        hlo = g.lower(*arrays, q_start).compile().as_text()
    assert_same(out, ref)
    assert not collectives(hlo)


def test_legacy_gspmd_partitioner():
    """jax_use_shardy_partitioner=False: the same decision through
    infer_sharding_from_operands."""
    prev = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        for c in (CASES[2], CASES[11]):  # S sharded with causal offsets; heads in groups + S
            ref, out, hlo, mesh, _ = run_case(c)
            assert_same(out, ref)
            assert not collectives(hlo)
    finally:
        jax.config.update("jax_use_shardy_partitioner", prev)


def test_consumer_keeps_sharding():
    """The sharded call composes with the surrounding program: an elementwise
    consumer keeps the sharding, and no collective appears."""
    mesh = make_mesh(*X8)
    c = Case("compose", X8, q=P(None, "x"), indices=P(None, "x"))
    arrays, q_start, kw = case_inputs(c)

    def f(q, k, i, l, s):
        out = attn_dist(q, k, i, l, q_start_index=s, **kw)
        return out / (out.sum(axis=1, keepdims=True) + 1.0)

    ref = unsharded(f, *arrays, q_start)
    sh = tuple(NamedSharding(mesh, s) for s in _in_specs(c, 3) + (P(),))
    g = jax.jit(f, in_shardings=sh)
    out = g(*arrays, q_start)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6, atol=1e-7)
    assert not collectives(g.lower(*arrays, q_start).compile().as_text())


# ----------------------------------------------------------------------------
# shard_map: the user passes each shard's q_start_index
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_def", [X8, XY24], ids=["1d", "2x4"])
def test_shard_map_with_user_offsets(mesh_def):
    mesh = make_mesh(*mesh_def)
    c = Case("shard_map", mesh_def, q=P(), indices=P(), k_stride=2)
    arrays, q_start, kw = case_inputs(c)
    ref = unsharded(_sharded_fn(kw), *arrays, q_start)
    if len(mesh_def[0]) == 1:
        b, s = None, "x"
    else:
        b, s = "x", "y"
    S_local = c.S // mesh.shape[s]

    @functools.partial(
        jax.shard_map, mesh=mesh,
        in_specs=(P(b, s), P(b), P(b, s), P(b, s), P(b)),
        out_specs=P(b, None, s),
    )
    def per_shard(q, k, i, l, q_start):
        shard_start = q_start + jax.lax.axis_index(s) * S_local
        return attn_dist(q, k, i, l, q_start_index=shard_start, **kw)

    out = jax.jit(per_shard)(*arrays, q_start)
    assert_same(out, ref)

    # Forgetting the offset gives a different (wrong) answer: the test sees it.
    @functools.partial(
        jax.shard_map, mesh=mesh,
        in_specs=(P(b, s), P(b), P(b, s), P(b, s), P(b)),
        out_specs=P(b, None, s),
    )
    def no_offset(q, k, i, l, q_start):
        return attn_dist(q, k, i, l, q_start_index=q_start, **kw)

    assert not np.allclose(np.asarray(jax.jit(no_offset)(*arrays, q_start)), ref)


def test_shard_map_over_some_axes_only():
    """shard_map manual over "x" only, S constrained over the automatic "y":
    the inner call is left to XLA's partitioner over "y"; exact result."""
    mesh = make_mesh(*XY24)
    c = Case("partial", XY24, q=P(), indices=P(), B=2)
    arrays, q_start, kw = case_inputs(c)
    ref = unsharded(_sharded_fn(kw), *arrays, q_start)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"),
                       axis_names={"x"})
    def per_batch_shard(q, k, i, l, q_start):
        q = jax.lax.with_sharding_constraint(q, P(None, "y"))
        return attn_dist(q, k, i, l, q_start_index=q_start, **kw)

    with jax.set_mesh(mesh):
        out = jax.jit(per_batch_shard)(*arrays, q_start)
    assert_same(out, ref)


# ----------------------------------------------------------------------------
# CUDA lowering of sharded calls (no GPU needed)
# ----------------------------------------------------------------------------

_KERNEL_CALL = re.compile(r"stablehlo\.custom_call @jax_attn_dist_fwd\(.*:\s*\((.*)\)\s*->\s*(tensor<[^>]*>)")


def _kernel_specs(B=2, S=64, H=128, T=32, N=100, D=576):
    SDS = jax.ShapeDtypeStruct
    return (
        SDS((B, S, H, D), jnp.bfloat16), SDS((B, N, 1, D), jnp.bfloat16),
        SDS((B, S, 1, T), jnp.int32), SDS((B, S, H), jnp.float32), SDS((B,), jnp.int32),
    )


def _kernel_fn(q, k, i, l, s):
    return attn_dist(q, k, i, l, lse_base="2", sm_scale=0.1, q_start_index=s)


def test_cuda_lowering_shard_map_has_per_shard_kernel_call(cross_lowering):
    mesh = make_mesh(*XY24)
    f = jax.shard_map(
        lambda q, k, i, l, s: _kernel_fn(q, k, i, l, s + jax.lax.axis_index("y") * 16),
        mesh=mesh, in_specs=(P(None, "y", "x"), P(), P(None, "y"), P(None, "y", "x"), P()),
        out_specs=P(None, "x", "y"),
    )
    text = jax.jit(f).trace(*_kernel_specs()).lower(lowering_platforms=("cuda",)).as_text()
    calls = [m for m in map(_KERNEL_CALL.search, text.splitlines()) if m]
    assert len(calls) == 1, text
    assert calls[0].group(1).startswith("tensor<2x16x64x576xbf16>")
    assert calls[0].group(2) == "tensor<2x1x16x32xf32>"


def test_cuda_lowering_of_jit_sharding_partitions_to_kernel_calls(cross_lowering):
    """A jit-sharded call lowered for CUDA holds jax's CustomSPMDPartitioning
    op with our Shardy rule; XLA's partitioner (at compile time, which needs
    a CUDA backend) calls our partition callback. We call that callback as
    XLA would, and check the per-shard module it returns: the kernel's custom
    call on local shapes, the S offset from partition_id, no collective."""
    from jax._src import custom_partitioning as cp
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    mesh = make_mesh(*XY24)
    specs = _kernel_specs()
    ns = lambda *s: NamedSharding(mesh, P(*s))  # noqa: E731
    in_sh = (ns(None, "y", "x"), ns(), ns(None, "y"), ns(None, "y", "x"), ns())
    out_sh = ns(None, "x", "y")
    lowered = jax.jit(_kernel_fn, in_shardings=in_sh, out_shardings=out_sh).trace(*specs).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "jax_attn_dist_fwd" not in text  # only after partitioning
    m = re.search(r'custom_call @CustomSPMDPartitioning\(.*backend_config = "(\d+)".*sdy\.sharding_rule', text)
    assert m, text
    key = m.group(1).encode()

    def xshape(a):
        return xc.Shape.array_shape(np.dtype(a.dtype), a.shape)

    out_spec = jax.ShapeDtypeStruct((2, 2, 64, 32), jnp.float32)
    # the primitive's operands: the five arguments and the (empty) row ranges [B, S, 0]
    ranges = jax.ShapeDtypeStruct((2, 64, 0), jnp.int32)
    module, arg_hlo, out_hlo = cp._custom_partitioning_partition(
        [xshape(a) for a in (*specs, ranges)],
        [s._to_xla_hlo_sharding(a.ndim) for s, a in zip((*in_sh, ns()), (*specs, ranges))],
        xshape(out_spec), out_sh._to_xla_hlo_sharding(4), key,
    )
    with mlir.make_ir_context():
        shard_text = str(ir.Module.parse(module))
    calls = [m for m in map(_KERNEL_CALL.search, shard_text.splitlines()) if m]
    assert len(calls) == 1, shard_text
    assert calls[0].group(1).startswith("tensor<2x16x64x576xbf16>")  # S/4, H/2 (one group)
    assert calls[0].group(2) == "tensor<2x1x16x32xf32>"
    assert "partition_id" in shard_text  # the shard's S offset
    assert not any(c.replace("-", "_") in shard_text for c in COLLECTIVES)
    # the partition keeps the operands as they came: no resharding of q
    assert arg_hlo[0] == in_sh[0]._to_xla_hlo_sharding(4)
    assert out_hlo == out_sh._to_xla_hlo_sharding(4)


def test_cuda_lowering_one_device_unchanged(cross_lowering):
    """Without a multi-device sharding the kernel call is emitted directly."""
    text = jax.jit(_kernel_fn).trace(*_kernel_specs()).lower(lowering_platforms=("cuda",)).as_text()
    assert "CustomSPMDPartitioning" not in text
    assert len([m for m in map(_KERNEL_CALL.search, text.splitlines()) if m]) == 1


@pytest.mark.parametrize("mesh_def,specs", [
    (X8, dict(q=P(), indices=P(None, None, None, "x"))),                       # T over 8 shards
    (XY42, dict(q=P(None, "x"), indices=P(None, "x", None, "y"))),             # S and T
])
def test_topk_length_with_t_sharded(mesh_def, specs):
    """SPEC §6.1 with attn_dist's T sharded: topk_length counts a row's slots
    from its first, so each T-shard sees it less its own first slot
    (Decision.localize). Sharded equals unsharded, and the slots past each
    row's length are 0."""
    mesh = make_mesh(*mesh_def)
    B, S, H, T = 2, 16, 4, 32
    q, k, idx, lse, kw = make_inputs(seed_of("t-sharded-topk", mesh_def), B=B, S=S, H=H, D=D, N=N, T=T,
                                     dtype=jnp.float32, q_start_index=N - S)
    rng = np.random.default_rng(seed_of("t-sharded-topk-lengths"))
    length = rng.integers(-3, T + 4, (B, S)).astype(np.int32)
    length[0, :4] = [0, 5, 17, T]  # shard edges of T / 8 = 4 and T / 2 = 16
    args = tuple(np.asarray(x) for x in (q, k, idx, lse)) + (length,)
    f = lambda q, k, i, l, n: attn_dist(q, k, i, l, topk_length=n, **kw)  # noqa: E731
    ref = unsharded(f, *args)
    in_sh = tuple(NamedSharding(mesh, s) for s in (specs["q"], P(), specs["indices"], P(*tuple(specs["q"])[:3]),
                                                    P(*tuple(specs["q"])[:2])))
    out = np.asarray(jax.jit(f, in_shardings=in_sh)(*args))
    assert_same(out, ref)
    live = np.clip(length, 0, T)
    for b in range(B):
        for s in range(S):
            assert not out[b, :, s, live[b, s]:].any()
