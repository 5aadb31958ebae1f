"""sparse_mla's deterministic backward when its rows (S) or heads (H) are
sharded: the same bits as the unsharded call (S-sharded; with H sharded
too, the same bits on every run of the mesh).

One call computes each batch element's fixed-point scale from its own rows
(SPEC §8.3), so a shard alone would pick a scale of its own. Here, per shard
(inside ``custom_partitioning``'s per-shard function, ``partitioning.py``):

1. ``BWD_BOUND_FFI_TARGET``: the row terms and the scale words [2, B]
   (max |kv|, the largest row bound), as the one call forms them;
2. ``pmax`` of the scale words over the shards: every shard's bound;
3. ``BWD_FIXED_FFI_TARGET``: dq and the shard's int64 sums at the scale of
   that bound and ``scale_rows`` (S of all shards, times the head shards,
   whose row terms add), as limbs [3, B, N, 1, D] and flags [B];
4. ``psum`` of limbs and flags (exact), and one kernel back to float32
   (``_core/fixed_point.py``).

With S alone sharded, the bound, the rows and the integer total are the
unsharded call's, and so are the bits. Two all-reduces (a [2, B] max and
the limbs' sum, 12 bytes per element of dkv) where the float32 path has
one of 4 bytes per element.
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
    return kernel_serves_shards(mesh, contract.check_canonical(*operands[:5]),
                                lambda pr: contract.bwd_kernel_supports(pr, d_v=params["d_v"]),
                                params["implementation"])


def sharded_deterministic_backward(operands, params, *, axes, scale_rows: int):
    """(dq, dkv float32) of one shard, dkv summed over ``axes`` (the mesh
    axes that shard S and H) at every shard's common scale."""
    ext.ensure_registered()
    q, kv = operands[:2]
    B, S, H, _ = q.shape
    _, N, _, D = kv.shape
    args = contract.bwd_ffi_operands(*operands)
    attrs = contract.ffi_attributes(**params)
    row_delta, words = jax.ffi.ffi_call(contract.BWD_BOUND_FFI_TARGET, (
        jax.ShapeDtypeStruct((B, S, H), jnp.float32),
        jax.ShapeDtypeStruct((2, B), jnp.int32),
    ))(*args, **attrs)
    words = jax.lax.pmax(words, axes)  # every shard's max |kv| and bound
    dq, limbs, flags, _ = jax.ffi.ffi_call(contract.BWD_FIXED_FFI_TARGET, (
        jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
        jax.ShapeDtypeStruct((3, B, N, 1, D), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((contract.bwd_fixed_workspace_bytes(q.shape, kv.shape),), jnp.uint8),
    ))(*args, row_delta, words, scale_rows=np.int64(scale_rows), **attrs)
    limbs, flags = jax.lax.psum(limbs, axes), jax.lax.psum(flags, axes)  # exact: no word overflows
    dkv = fixed_point.limbs_to_float(limbs.reshape(3, B, N * D), flags, words[1], scale_rows)
    return dq, dkv.reshape(kv.shape)
