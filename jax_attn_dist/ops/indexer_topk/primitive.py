"""indexer_topk's logical primitive (SPEC §9) and its lowerings.

* ``indexer_topk_p``: (index_q [B,S,HI,DI], index_k [B,N,DI], weights
  [B,S,HI], index_k_scale [B,N] f32, q_start [B] int32, row_ranges
  [B,S,3|0] int32) -> indices [B,S,1,topk] int32.

Static parameters: ``topk`` (int >= 1), ``scale`` (float), ``causal``
(bool), ``k_stride`` (int) and ``implementation`` (None/"cuda"/"xla").

It lowers through custom_partitioning (``partitioning.py``) to an inner
per-shard primitive, whose CUDA lowering calls the SM90 selection kernel
where it applies; elsewhere the chunked jnp path (``reference.py``). vmap
folds into B (``_core/batching.py``). It has no differentiation rule: the
public function binds it on detached operands (``backward.py``).
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
from .reference import indexer_topk_reference_canonical


def _abstract(index_q, index_k, weights, index_k_scale, q_start, row_ranges, *, topk, **params):
    problem = contract.check_canonical(index_q, index_k, weights, index_k_scale, q_start, row_ranges)
    return jax.core.ShapedArray((problem.B, problem.S, 1, topk), jnp.int32)


indexer_topk_p = define_primitive("indexer_topk", _abstract, multiple_results=False)
indexer_topk_local_p = define_primitive("indexer_topk_local", _abstract, multiple_results=False)


def _ffi_selection(index_q, index_k, weights, index_k_scale, q_start, row_ranges, *, topk, scale, causal, k_stride,
                   implementation):
    """The SM90 selection kernel through XLA's FFI. Operand order, attribute
    names and types are the C++ handler's contract (csrc/indexer_topk/):
    Buffer index_q [B,S,HI,DI] (BF16 or F8E4M3FN), Buffer index_k [B,N,DI]
    (the same dtype), Buffer<F32> weights [B,S,HI], Buffer<F32>
    index_k_scale [B,N], Buffer<S32> q_start [B], Buffer<S32> row_ranges
    [B,S,3] or [B,S,0] (fields 0 and 1 used); attrs scale f32, causal bool,
    k_stride int32; result Buffer<S32> indices [B,S,1,topk] (topk from its
    shape)."""
    del implementation
    out = jax.ShapeDtypeStruct(tuple(index_q.shape[:2]) + (1, topk), jnp.int32)
    return jax.ffi.ffi_call(contract.FFI_TARGET, out)(
        index_q, index_k, weights.astype(jnp.float32), index_k_scale.astype(jnp.float32), q_start, row_ranges,
        scale=np.float32(scale), causal=bool(causal), k_stride=np.int32(k_stride),
    )


def _selection_jnp(*operands, topk, scale, causal, k_stride, **unused):
    return indexer_topk_reference_canonical(*operands, topk=topk, scale=scale, causal=causal, k_stride=k_stride)


def _out_specs(front):  # indices [V, B, S, 1, topk]: as index_q's V, B, S
    return P(*dim_specs(front[0])[:3])


ext.declare_ffi_targets(contract.FFI_TARGET)
register_platform_lowerings(
    indexer_topk_local_p, who="indexer_topk", check=contract.check_canonical,
    supports=contract.kernel_supports, supports_params=("topk",), jnp_impl=_selection_jnp, kernel_impl=_ffi_selection,
    multiple_results=False,
)
register_partitioned_lowering(indexer_topk_p, indexer_topk_local_p, PARTITIONING)
register_batching(indexer_topk_p, _out_specs)
