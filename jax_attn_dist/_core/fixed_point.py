"""Deterministic fixed-point sums added over shards (SPEC §8.3).

A deterministic backward sums a key gradient as 64-bit fixed-point integers
with a scale chosen from a bound on every row's terms: exact, so the same
bits in any order. When the rows are sharded, each shard holds the integer
sums of its rows. For the total to be the unsharded call's, every shard must
use the same scale (from the maximum of the shards' bounds and the rows of
all shards) and the shards' integers must be added exactly. JAX without x64
has no int64 array, so each shard's sums travel as three 21-bit limbs in
int32 words (``csrc/common/fixed_point_limbs.cuh``): ``psum`` adds them
without overflow over up to ``MAX_SHARDS`` shards, and one kernel rejoins
the limbs in int64 and converts them to float32 exactly as the unsharded
call converts its sums. The bounds travel as float bits in int32 words
(non-negative: their integer order is the floats'), so ``pmax`` gives every
shard the same bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import ext

#: The FFI target: (limbs int32 [3, G, M], flags int32 [G], bound bits
#: int32 [G]) -> float32 [G, M]; attr rows int64 (csrc/fixed_point/ffi.h).
LIMBS_TO_FLOAT_TARGET = "jax_attn_dist_fixed_point_limbs_to_float"
#: (2^21 - 1) * 1024 < 2^31: the most shards whose limbs add in int32.
MAX_SHARDS = 1024

ext.declare_ffi_targets(LIMBS_TO_FLOAT_TARGET)


#: The most rows one fixed-point scale is chosen for (the kernels check it too).
MAX_SCALE_ROWS = 2 ** 40


def check_shard_count(shards: int, who: str, rows: int = 1) -> None:
    """``shards``: the shards whose limbs one all-reduce adds; ``rows``: the
    rows the common scale is chosen for."""
    if shards > MAX_SHARDS:
        raise ValueError(f"{who}: deterministic=True sums fixed-point limbs over at most {MAX_SHARDS} shards of its "
                         f"rows, got {shards}; shard fewer ways or use deterministic=False")
    if rows > MAX_SCALE_ROWS:
        raise ValueError(f"{who}: deterministic=True chooses one fixed-point scale for at most 2^40 rows, got {rows}")


def limbs_to_float(limbs, flags, bound_bits, rows: int):
    """float32 [G, M] from added limbs [3, G, M] int32, flags [G] (non-zero:
    some shard flagged a non-finite term, giving NaN over the group) and
    bound bits [G], with the scale chosen for ``rows`` rows (the CUDA
    kernel: needs int64 arithmetic)."""
    _, G, M = limbs.shape
    return jax.ffi.ffi_call(LIMBS_TO_FLOAT_TARGET, jax.ShapeDtypeStruct((G, M), jnp.float32))(
        limbs, flags, bound_bits, rows=int(rows))
