"""The indexer loss's logical primitives (SPEC §5) and their lowerings.

* ``indexer_kl_p``: (index_q [B,S,HI,DI], index_k [B,N,DI], weights [B,S,HI],
  indices [B,S,1,T] int32, target [B,S,T] f32, q_start [B] int32,
  row_ranges [B,S,3|0] int32) -> (kl [B,S] f32, lse [B,S] f32). ``lse`` is the per-row log-sum-exp of
  the valid logits, the residual the backward uses.
* ``indexer_kl_bwd_p``: the same operands plus ``lse`` and the cotangent
  ``g`` [B,S] -> (d index_q, d index_k, d weights) in the primal dtypes.

Static parameters: ``scale`` (float), ``causal`` (bool), ``k_stride`` (int),
``deterministic`` (bool) and ``implementation`` (None/"cuda"/"xla").

Each lowers through custom_partitioning (``partitioning.py``) to an inner
per-shard primitive, whose CUDA lowering calls the SM90 kernels where they
apply (the backward kernels: HI <= 64, either mode); elsewhere the chunked
jnp passes (``_core/primitives.py``). vmap folds into B
(``_core/batching.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..._core import ext
from ..._core.batching import register_batching
from ..._core.explicit_axes import dim_specs
from ..._core.partitioning import register_partitioned_lowering
from ..._core.primitives import define_primitive, register_platform_lowerings
from . import contract
from .backward import indexer_bwd_canonical
from .partitioning import BWD_PARTITIONING, FWD_PARTITIONING
from .reference import indexer_reference_canonical


def _fwd_abstract(index_q, index_k, weights, indices, target, q_start, row_ranges, **params):
    problem = contract.check_canonical(index_q, index_k, weights, indices, target, q_start, row_ranges)
    row = jax.core.ShapedArray(problem.canonical_out_shape, jnp.float32)
    return row, row


def _bwd_abstract(index_q, index_k, weights, indices, target, q_start, row_ranges, lse, g, **params):
    problem = contract.check_canonical(index_q, index_k, weights, indices, target, q_start, row_ranges)
    for name, x in (("lse", lse), ("g", g)):
        if tuple(x.shape) != problem.canonical_out_shape or jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(
                f"indexer_kl backward: `{name}` must be float32 {list(problem.canonical_out_shape)}, "
                f"got {jnp.dtype(x.dtype).name} {list(x.shape)}"
            )
    return tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in (index_q, index_k, weights))


indexer_kl_p = define_primitive("indexer_kl", _fwd_abstract, multiple_results=True)
indexer_kl_local_p = define_primitive("indexer_kl_local", _fwd_abstract, multiple_results=True)
indexer_kl_bwd_p = define_primitive("indexer_kl_bwd", _bwd_abstract, multiple_results=True)
indexer_kl_bwd_local_p = define_primitive("indexer_kl_bwd_local", _bwd_abstract, multiple_results=True)


def _ffi_forward(index_q, index_k, weights, indices, target, q_start, row_ranges, *, scale, causal, k_stride,
                 deterministic, implementation):
    """The SM90 forward kernel through XLA's FFI. Operand order, attribute
    names and types are the C++ handler's contract (csrc/indexer/ffi.cc):
    Buffer<BF16> index_q [B,S,HI,DI], Buffer<BF16> index_k [B,N,DI],
    Buffer<F32> weights [B,S,HI], Buffer<S32> indices [B,S,1,T],
    Buffer<F32> target [B,S,T], Buffer<S32> q_start [B], Buffer<S32>
    row_ranges [B,S,3] or [B,S,0]; attrs scale f32,
    causal bool, k_stride int32; results Buffer<F32> kl [B,S],
    Buffer<F32> lse [B,S]."""
    row = jax.ShapeDtypeStruct(index_q.shape[:2], jnp.float32)
    return jax.ffi.ffi_call(contract.FWD_FFI_TARGET, (row, row))(
        index_q, index_k, weights.astype(jnp.float32), indices, target, q_start, row_ranges,
        **contract.ffi_attributes(scale=scale, causal=causal, k_stride=k_stride),
    )


def _ffi_backward(index_q, index_k, weights, indices, target, q_start, row_ranges, lse, g, *, scale, causal,
                  k_stride, deterministic, implementation):
    """The SM90 backward kernels through XLA's FFI (csrc/indexer/ffi.cc): the
    forward's operands up to q_start, Buffer<F32> lse [B,S], Buffer<F32> g
    [B,S], then row_ranges (the handler's optional last operand);
    attrs as the forward's plus deterministic bool; results Buffer<BF16>
    d index_q [B,S,HI,DI], Buffer<F32> d weights [B,S,HI], Buffer<F32>
    d index_k [B,N,DI] (cast here) and Buffer<U8> workspace (the
    deterministic mode's fixed-point sums; XLA allocates it, the handler
    allocates nothing)."""
    del implementation
    workspace = contract.bwd_workspace_bytes(index_k.shape, deterministic=deterministic)
    dq, dw, dk, _ = jax.ffi.ffi_call(contract.BWD_FFI_TARGET, (
        jax.ShapeDtypeStruct(index_q.shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(weights.shape, jnp.float32),
        jax.ShapeDtypeStruct(index_k.shape, jnp.float32),
        jax.ShapeDtypeStruct((workspace,), jnp.uint8),
    ))(index_q, index_k, weights.astype(jnp.float32), indices, target, q_start, lse, g.astype(jnp.float32),
       row_ranges,
       **contract.ffi_attributes(scale=scale, causal=causal, k_stride=k_stride),
       deterministic=bool(deterministic))
    return dq, dk.astype(index_k.dtype), dw.astype(weights.dtype)


def _forward_jnp(*operands, scale, causal, k_stride, **unused):
    return indexer_reference_canonical(*operands, scale=scale, causal=causal, k_stride=k_stride)


def _backward_jnp(*operands, scale, causal, k_stride, deterministic, **unused):
    return indexer_bwd_canonical(*operands, scale=scale, causal=causal, k_stride=k_stride,
                                 deterministic=deterministic)


def _fwd_out_specs(front):  # kl, lse [V, B, S]: as index_q
    return (P(*dim_specs(front[0])[:3]),) * 2


def _bwd_out_specs(front):  # d index_q, d index_k, d weights: as their primals
    return tuple(P(*dim_specs(front[i])) for i in (0, 1, 2))


ext.declare_ffi_targets(contract.FWD_FFI_TARGET, contract.FWD_FFI_TEST_TARGET, contract.BWD_FFI_TARGET,
                        contract.BWD_FFI_TEST_TARGET, contract.BWD_BOUND_FFI_TARGET, contract.BWD_FIXED_FFI_TARGET)
register_platform_lowerings(
    indexer_kl_local_p, who="indexer_kl", check=contract.check_canonical,
    supports=contract.kernel_supports, jnp_impl=_forward_jnp, kernel_impl=_ffi_forward,
    multiple_results=True,
)
register_platform_lowerings(
    indexer_kl_bwd_local_p, who="indexer_kl backward",
    check=lambda *avals: contract.check_canonical(*avals[:7]),
    supports=contract.bwd_kernel_supports, supports_params=("deterministic",),
    jnp_impl=_backward_jnp, kernel_impl=_ffi_backward, multiple_results=True,
)
register_partitioned_lowering(indexer_kl_p, indexer_kl_local_p, FWD_PARTITIONING)
register_partitioned_lowering(indexer_kl_bwd_p, indexer_kl_bwd_local_p, BWD_PARTITIONING)
register_batching(indexer_kl_p, _fwd_out_specs)
register_batching(indexer_kl_bwd_p, _bwd_out_specs)
