"""indexer_kl's deterministic backward when its rows are sharded (over B or
S): the same bits as the unsharded call.

One call chooses a single fixed-point scale for d index_k from all its rows
(SPEC §5.3), so a shard alone would pick a scale of its own. Here, per shard
(inside ``custom_partitioning``'s per-shard function, ``partitioning.py``):

1. ``BWD_BOUND_FFI_TARGET``: the shard's largest row bound [1];
2. ``pmax`` over the B- and S-shards: the bound over all rows;
3. ``BWD_FIXED_FFI_TARGET``: d index_q, d weights and the shard's int64 sums
   at that scale for ``scale_rows`` (B * S of all shards), as limbs
   [3, 1, B * N * DI] and a flag [1];
4. ``psum`` of the limbs over the S-shards (exact; a B-shard holds other
   batch elements' sums; none with B alone sharded) and of the flag over
   the B- and S-shards, and one kernel back to float32
   (``_core/fixed_point.py``).

The bound, the rows and the integer totals are the unsharded call's, and so
are the bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..._core import ext
from ..._core import fixed_point
from ..._core.primitives import kernel_serves_shards
from . import contract


def kernel_serves(operands, params, mesh) -> bool:
    """Whether each shard's backward runs the CUDA kernel (the inner
    primitive's CUDA lowering would pick it, on a CUDA mesh)."""
    return kernel_serves_shards(
        mesh, contract.check_canonical(*operands[:7]),
        lambda pr: contract.bwd_kernel_supports(pr, deterministic=params["deterministic"]), params["implementation"])


def sharded_deterministic_backward(operands, params, *, bound_axes, sum_axes, scale_rows: int):
    """(d index_q, d index_k, d weights) of one shard, d index_k summed over
    ``sum_axes`` (the mesh axes that shard S) at the scale of the bound over
    ``bound_axes`` (those that shard B and S) and ``scale_rows`` rows."""
    ext.ensure_registered()
    index_q, index_k, weights, indices, target, q_start, row_ranges, lse, g = operands
    B, _, _, _ = index_q.shape
    _, N, DI = index_k.shape
    args = (index_q, index_k, weights.astype(jnp.float32), indices, target, q_start, lse, g.astype(jnp.float32))
    attrs = contract.ffi_attributes(**params)
    bound = jax.ffi.ffi_call(contract.BWD_BOUND_FFI_TARGET, jax.ShapeDtypeStruct((1,), jnp.int32))(
        *args, row_ranges, **attrs)
    bound = jax.lax.pmax(bound, bound_axes)  # the bound over all rows
    dq, dw, limbs, flags, _ = jax.ffi.ffi_call(contract.BWD_FIXED_FFI_TARGET, (
        jax.ShapeDtypeStruct(index_q.shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(weights.shape, jnp.float32),
        jax.ShapeDtypeStruct((3, 1, B * N * DI), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((contract.bwd_workspace_bytes(index_k.shape, deterministic=True),), jnp.uint8),
    ))(*args, bound, row_ranges, scale_rows=np.int64(scale_rows), **attrs)
    limbs = jax.lax.psum(limbs, sum_axes)
    flags = jax.lax.psum(flags, bound_axes)
    dk = fixed_point.limbs_to_float(limbs, flags, bound, scale_rows).reshape(index_k.shape)
    return dq, dk.astype(index_k.dtype), dw.astype(weights.dtype)
