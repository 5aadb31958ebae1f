"""The partitioning driver both ops share (jax_attn_dist/_core/partitioning.py),
on 8 host CPU devices: if a jax release moves the private API that reads
operand shardings, a sharded call must stay correct (every operand gathered)
and say so, not silently. (Each op's sharding rules are tested in its own
folder: attn_dist/test_sharding.py, indexer/test_sharding.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from inputs import make_indexer_inputs, make_inputs, seed_of
from jax_attn_dist import attn_dist, indexer_kl
from jax_attn_dist._core import partitioning
from sharding_util import collectives

pytestmark = pytest.mark.host_devices(8)


def attn_dist_call():
    q, k, idx, lse, kw = make_inputs(seed_of("private-api-gone", "attn_dist"), B=4, S=24, H=64, D=16, N=40, T=16,
                                     dtype=jnp.float32, q_start_index="batch")
    qs = kw.pop("q_start_index")
    f = lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw)  # noqa: E731
    return f, (q, k, idx, lse, qs), (P(None, "x"), P(), P(None, "x"), P(None, "x"), P())


def indexer_call():
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("private-api-gone", "indexer"), B=2, S=24, HI=8, DI=16,
                                                  N=24, T=12, dtype=jnp.float32, q_start_index="batch")
    qs = kw.pop("q_start_index")
    f = lambda a, b, c, d, e, s: indexer_kl(a, b, c, d, e, q_start_index=s, **kw)  # noqa: E731
    row = P(None, "x")
    return f, (iq, ik, w, idx, tgt, qs), (row, P(), row, row, row, P())


@pytest.mark.parametrize("call", [attn_dist_call, indexer_call], ids=["attn_dist", "indexer"])
def test_private_sharding_api_missing_gathers_and_warns(monkeypatch, call):
    import jax._src.sharding_impls as sharding_impls

    f, args, specs = call()
    with jax.default_device(jax.devices("cpu")[0]):
        ref = np.asarray(jax.jit(f)(*args))
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    monkeypatch.delattr(sharding_impls, "parse_flatten_op_sharding")
    partitioning._warn_once.cache_clear()
    g = jax.jit(f, in_shardings=shardings)
    with pytest.warns(RuntimeWarning, match="cannot read operand shardings"):
        out = g(*args)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
    assert (ref > 0).any() and "all-gather" in collectives(g.lower(*args).compile().as_text())
