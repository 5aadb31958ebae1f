"""attn_dist's primitives and their lowerings, vmap and partitioning rules.

* ``attn_dist_p``, the logical primitive: canonical operands q [B,S,H,D],
  k [B,N,HK,D], indices [B,S,HK,T] int32, lse [B,S,H] float32, q_start [B]
  int32, row_ranges [B,S,3] or [B,S,0] int32 (``_core.checks.ROW_RANGE_FIELDS``)
  -> out [B,G,S,T] float32; static, checked parameters ``sm_scale``,
  ``causal``, ``k_stride``, ``lse_base``, ``implementation``. Its vmap rule
  folds vmapped axes into B (``_core/batching.py``); it lowers through
  custom_partitioning (``partitioning.py``) to the per-shard primitive.
* ``attn_dist_local_p``, the per-shard primitive: the same operands and
  parameters; its lowering picks the CUDA kernel or the jnp reference
  (``_core/primitives.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..._core import ext
from ..._core.batching import register_batching
from ..._core.explicit_axes import dim_specs
from ..._core.partitioning import register_partitioned_lowering
from ..._core.primitives import define_primitive, register_platform_lowerings
from . import contract
from .partitioning import PARTITIONING
from .reference import reference_canonical


def _abstract_eval(q, k, indices, lse, q_start, row_ranges, *, sm_scale, causal, k_stride, lse_base,
                   implementation):
    problem = contract.check_canonical(q, k, indices, lse, q_start, row_ranges)
    return jax.core.ShapedArray(problem.canonical_out_shape, jnp.float32)


attn_dist_p = define_primitive("attn_dist", _abstract_eval, multiple_results=False)
attn_dist_local_p = define_primitive("attn_dist_local", _abstract_eval, multiple_results=False)


def _ffi_forward(q, k, indices, lse, q_start, row_ranges, *, sm_scale, causal, k_stride, lse_base,
                 implementation):
    """The CUDA kernel through XLA's FFI. Operand order, attribute names and
    attribute types are the C++ handler's contract (csrc/attn_dist/ffi.cc):
    Buffer<BF16> q [B,S,H,D], Buffer<BF16> k [B,N,1,D], Buffer<S32> indices
    [B,S,1,T], Buffer<F32> lse [B,S,H], Buffer<S32> q_start [B],
    Buffer<S32> row_ranges [B,S,3] or [B,S,0]; attrs
    sm_scale f32, causal bool, k_stride int32, lse_base_e bool; result
    Buffer<F32> [B,G,S,T]."""
    B, S, H, _ = q.shape
    T = indices.shape[-1]
    out_type = jax.ShapeDtypeStruct((B, contract.num_groups(H), S, T), jnp.float32)
    return jax.ffi.ffi_call(contract.FFI_TARGET, out_type)(
        q, k, indices, lse, q_start, row_ranges,
        sm_scale=np.float32(sm_scale),
        causal=bool(causal),
        k_stride=np.int32(k_stride),
        lse_base_e=bool(lse_base == "e"),
    )


def _out_specs(front):  # [V, B, G, S, T]: V, B, S as q, T as indices
    q_spec, i_spec = dim_specs(front[0]), dim_specs(front[2])
    return P(q_spec[0], q_spec[1], None, q_spec[2], i_spec[4])


ext.declare_ffi_targets(contract.FFI_TARGET, contract.FFI_TEST_TARGET)
register_platform_lowerings(
    attn_dist_local_p, who="attn_dist", check=contract.check_canonical, supports=contract.kernel_supports,
    jnp_impl=reference_canonical, kernel_impl=_ffi_forward, multiple_results=False,
)
register_partitioned_lowering(attn_dist_p, attn_dist_local_p, PARTITIONING)
register_batching(attn_dist_p, _out_specs)
