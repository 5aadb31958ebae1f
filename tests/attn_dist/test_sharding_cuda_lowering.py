"""The CUDA lowering of sharded attn_dist calls, on 8 CPU devices (conftest.py
sets --xla_force_host_platform_device_count=8; no GPU needed): under shard_map
the per-shard module holds the kernel's custom call on local shapes; a
jit-sharded call holds jax's CustomSPMDPartitioning op, whose partition
callback returns that per-shard module; without a multi-device sharding the
kernel call is emitted directly. The meshes are in
support/attn_dist_sharding_cases.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_attn_dist import attn_dist
from attn_dist_sharding_cases import XY24, make_mesh
from sharding_util import COLLECTIVES

pytestmark = pytest.mark.host_devices(8)

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
