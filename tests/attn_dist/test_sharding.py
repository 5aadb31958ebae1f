"""Sharding on 8 CPU devices (conftest.py sets --xla_force_host_platform_device_count=8).

Every supported sharding of attn_dist (B, S, T, whole 64-head groups of H) on
1-D and 2-D meshes equals the unsharded result, and the compiled program holds
no collective and only per-shard shapes; the documented fallbacks (heads split
inside a group, K or q's D sharded) gather and still give the same result.
Also: shardings carried by the arrays, pjit-style specs, the legacy GSPMD
partitioner, a consumer of the sharded call, and T sharded with topk_length.
shard_map with user offsets is in test_shard_map.py; the CUDA lowering of a
sharded call in test_sharding_cuda_lowering.py. Their shared cases and helpers
are in support/attn_dist_sharding_cases.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_attn_dist import attn_dist
from attn_dist_sharding_cases import (
    D, N, X8, XY24, XY42, Case, assert_same, case_inputs, in_specs, make_mesh, sharded_fn, unsharded,
)
from inputs import make_inputs, seed_of
from sharding_util import collectives, partitioner

pytestmark = pytest.mark.host_devices(8)


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


def run_case(c: Case):
    """(unsharded out, sharded out, compiled sharded HLO, mesh)."""
    mesh = make_mesh(*c.mesh)
    arrays, q_start, kw = case_inputs(c)
    python_q_start = q_start if isinstance(q_start, int) else None
    f = sharded_fn(kw, python_q_start)
    args = arrays if python_q_start is not None else arrays + (q_start,)
    ref = unsharded(f, *args)
    specs = in_specs(c, arrays[3].ndim) + (() if python_q_start is not None else (P(),))
    in_sh = tuple(NamedSharding(mesh, s) for s in specs)
    jit_kw = dict(in_shardings=in_sh)
    if c.out is not None:
        jit_kw["out_shardings"] = NamedSharding(mesh, c.out)
    g = jax.jit(f, **jit_kw)
    out = g(*args)
    hlo = g.lower(*args).compile().as_text()
    return np.asarray(ref), out, hlo, mesh, arrays


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
    f = sharded_fn(kw)
    ref = unsharded(f, *arrays, q_start)
    put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, in_specs(c, 3))]
    g = jax.jit(f)
    out = g(*put, q_start)
    assert_same(out, ref)
    assert not collectives(g.lower(*put, q_start).compile().as_text())


def test_pjit_style_partition_specs_under_mesh():
    """pjit style: jax.jit with bare PartitionSpecs under a mesh context."""
    mesh = make_mesh(*XY24)
    c = Case("pjit", XY24, q=P("x", "y"), indices=P("x", "y"))
    arrays, q_start, kw = case_inputs(c)
    f = sharded_fn(kw)
    ref = unsharded(f, *arrays, q_start)
    with jax.set_mesh(mesh):
        g = jax.jit(f, in_shardings=in_specs(c, 3) + (P(),), out_shardings=P("x", None, "y"))
        out = g(*arrays, q_start)
        hlo = g.lower(*arrays, q_start).compile().as_text()
    assert_same(out, ref)
    assert not collectives(hlo)


def test_legacy_gspmd_partitioner():
    """jax_use_shardy_partitioner=False: the same decision through
    infer_sharding_from_operands."""
    with partitioner(shardy=False):
        for c in (CASES[2], CASES[11]):  # S sharded with causal offsets; heads in groups + S
            ref, out, hlo, mesh, _ = run_case(c)
            assert_same(out, ref)
            assert not collectives(hlo)


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
    sh = tuple(NamedSharding(mesh, s) for s in in_specs(c, 3) + (P(),))
    g = jax.jit(f, in_shardings=sh)
    out = g(*arrays, q_start)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6, atol=1e-7)
    assert not collectives(g.lower(*arrays, q_start).compile().as_text())


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
