"""attn_dist under shard_map on 8 CPU devices (conftest.py sets
--xla_force_host_platform_device_count=8): the user passes each shard's
q_start_index, and the per-shard calls equal the unsharded one (forgetting
the offset does not); shard_map manual over some mesh axes only, the rest left
to XLA's partitioner. The cases and helpers are in
support/attn_dist_sharding_cases.py.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_attn_dist import attn_dist
from attn_dist_sharding_cases import X8, XY24, Case, assert_same, case_inputs, make_mesh, sharded_fn, unsharded

pytestmark = pytest.mark.host_devices(8)


@pytest.mark.parametrize("mesh_def", [X8, XY24], ids=["1d", "2x4"])
def test_shard_map_with_user_offsets(mesh_def):
    mesh = make_mesh(*mesh_def)
    c = Case("shard_map", mesh_def, q=P(), indices=P(), k_stride=2)
    arrays, q_start, kw = case_inputs(c)
    ref = unsharded(sharded_fn(kw), *arrays, q_start)
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
    ref = unsharded(sharded_fn(kw), *arrays, q_start)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"),
                       axis_names={"x"})
    def per_batch_shard(q, k, i, l, q_start):
        q = jax.lax.with_sharding_constraint(q, P(None, "y"))
        return attn_dist(q, k, i, l, q_start_index=q_start, **kw)

    with jax.set_mesh(mesh):
        out = jax.jit(per_batch_shard)(*arrays, q_start)
    assert_same(out, ref)
