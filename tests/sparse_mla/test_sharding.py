"""sparse_mla sharded on 8 CPU devices (conftest.py sets
--xla_force_host_platform_device_count=8): B, S and H shardings on 1-D and
2-D meshes equal the unsharded result with no collective and per-shard
shapes only; kv sharded over N, and heads of HK > 1, are gathered and still
give the same result; packed rows with S sharded; the legacy GSPMD
partitioner; gradients of a sharded call."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from inputs import seed_of
from jax_attn_dist import sparse_mla
from sharding_util import collectives, partitioner
from sparse_mla_cases import make_sparse_mla_inputs

pytestmark = pytest.mark.host_devices(8)

X8 = ((8,), ("x",))
XY24 = ((2, 4), ("x", "y"))


def make_mesh(shape, names):
    devices = np.array(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


class Case(NamedTuple):
    name: str
    mesh: Tuple[Tuple[int, ...], Tuple[str, ...]]
    q: P                      # q [B, S, H, D]; indices take its B and S entries
    kv: P = P()
    out: Optional[P] = None   # out_shardings of out (lse takes its first three entries)
    B: int = 4
    H: int = 16
    HK: int = 1
    clean: bool = True        # no collective at all


CASES = [
    Case("1d-batch", X8, q=P("x"), B=8, out=P("x")),
    Case("1d-seq-per-batch-qstart", X8, q=P(None, "x"), out=P(None, "x")),
    Case("1d-heads", X8, q=P(None, None, "x"), out=P(None, None, "x")),
    Case("2x4-batch-seq", XY24, q=P("x", "y")),
    Case("2x4-seq-heads", XY24, q=P(None, "y", "x"), out=P(None, "y", "x")),
    Case("1d-kv-over-N-gathered", X8, q=P(None, "x"), kv=P(None, "x"), clean=False),
    Case("1d-heads-hk2-gathered", X8, q=P(None, None, "x"), H=16, HK=2, clean=False),
]


def case_inputs(c: Case):
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("shard", c.name), B=c.B, S=32, H=c.H, HK=c.HK, D=16, N=24, T=8,
                                            dtype=jnp.float32, q_start_index="batch", empty_rows=0.1)
    qs = np.asarray(kw.pop("q_start_index"))
    return tuple(np.asarray(x) for x in (q, kv, idx)) + (qs,), kw


def unsharded(f, *args):
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.tree.map(np.asarray, jax.jit(f)(*args))


def assert_same(got, want):
    for a, b in zip(got, want):
        a = np.asarray(a)
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b[np.isfinite(b)]).max()))


def run_case(c: Case):
    mesh = make_mesh(*c.mesh)
    args, kw = case_inputs(c)
    f = lambda q, kv, i, s: sparse_mla(q, kv, i, q_start_index=s, **kw)  # noqa: E731
    ref = unsharded(f, *args)
    q_spec = tuple(c.q) + (None,) * (4 - len(tuple(c.q)))
    specs = (c.q, c.kv, P(*q_spec[:2]), P())
    jit_kw = dict(in_shardings=tuple(NamedSharding(mesh, s) for s in specs))
    if c.out is not None:
        o = tuple(c.out) + (None,) * (4 - len(tuple(c.out)))
        jit_kw["out_shardings"] = (NamedSharding(mesh, P(*o)), NamedSharding(mesh, P(*o[:3])))
    g = jax.jit(f, **jit_kw)
    return ref, g(*args), g.lower(*args).compile().as_text(), args


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sharded_equals_unsharded(case):
    ref, out, hlo, args = run_case(case)
    assert_same(out, ref)
    assert np.isneginf(ref[1]).any() and np.isfinite(ref[1]).any()
    if case.clean:
        assert not collectives(hlo), f"unexpected collectives {collectives(hlo)}"
        q = args[0]
        assert f"f32[{','.join(map(str, q.shape))}]" not in hlo, "q exists whole somewhere"
    else:
        assert "all-gather" in hlo


def test_legacy_gspmd_partitioner():
    with partitioner(shardy=False):
        for c in (CASES[1], CASES[4]):
            ref, out, hlo, _ = run_case(c)
            assert_same(out, ref)
            assert not collectives(hlo)


def test_packed_rows_with_seq_sharded():
    """SPEC §6's row ranges are sharded with their rows (absolute key
    positions: no offset needed)."""
    mesh = make_mesh(*X8)
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("shard-packed"), S=32, H=4, D=16, N=24, T=8, dtype=jnp.float32,
                                            indices="uniform")
    kw.pop("q_start_index")
    cu_q, cu_k = jnp.asarray([0, 10, 25, 30], jnp.int32), jnp.asarray([0, 7, 20, 24], jnp.int32)
    tl = jnp.asarray(np.random.default_rng(0).integers(0, 10, (32,)), jnp.int32)

    def f(q, kv, i, t, cq, ck):
        return sparse_mla(q, kv, i, topk_length=t, cu_seqlens_q=cq, cu_seqlens_k=ck, q_start_index=3, **kw)

    args = (q, kv, idx, tl, cu_q, cu_k)
    ref = unsharded(f, *args)
    sh = [NamedSharding(mesh, s) for s in (P("x"), P(), P("x"), P("x"), P(), P())]
    assert_same(jax.jit(f, in_shardings=sh)(*args), ref)


def test_gradients_of_a_sharded_call():
    mesh = make_mesh(*XY24)
    args, kw = case_inputs(Case("grad", XY24, q=P("x", "y")))

    def loss(q, kv, i, s):
        out, lse = sparse_mla(q, kv, i, q_start_index=s, **kw)
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    g = jax.grad(loss, argnums=(0, 1))
    ref = unsharded(g, *args)
    sh = [NamedSharding(mesh, s) for s in (P("x", "y"), P(), P("x", "y"), P())]
    got = jax.jit(g, in_shardings=sh)(*args)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
