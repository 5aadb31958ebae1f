"""sparse_mla's primitives and their lowerings, vmap and partitioning rules.

* ``sparse_mla_p``, the logical primitive: canonical operands q [B,S,H,D],
  kv [B,N,HK,D], indices [B,S,HK,T] int32, q_start [B] int32, row_ranges
  [B,S,3] or [B,S,0] int32 (``_core.checks.ROW_RANGE_FIELDS``) -> (out
  [B,S,H,d_v] in q's dtype, lse [B,S,H] float32); static, checked
  parameters ``sm_scale``, ``causal``, ``k_stride``, ``lse_base``, ``d_v``,
  ``deterministic``, ``implementation``. Its vmap rule folds vmapped axes
  into B (``_core/batching.py``); it lowers through custom_partitioning
  (``partitioning.py``) to the per-shard primitive.
* ``sparse_mla_local_p``, the per-shard primitive: the same operands and
  parameters; its lowering picks the CUDA kernel or the jnp reference
  (``_core/primitives.py``).
* ``sparse_mla_bwd_p``, the backward's logical primitive: the forward's
  operands plus the forward's results and their cotangents, out
  [B,S,H,d_v] (q's dtype), lse [B,S,H] float32, dout [B,S,H,d_v], dlse
  [B,S,H] -> (dq like q, dkv float32 like kv's shape: the shards' partial
  sums are added before one rounding); the same static parameters. Folded
  by vmap and partitioned like the forward (S- and H-shards' dkv psum'ed).
* ``sparse_mla_bwd_local_p``, its per-shard primitive: on CUDA the SM90
  backward kernel where it applies (the forward kernel's coverage, either
  mode), elsewhere the chunked jnp backward (``backward.py``, which does not
  need ``out``).
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
from .backward import sparse_mla_bwd_canonical
from .partitioning import BWD_PARTITIONING, PARTITIONING
from .reference import reference_canonical


def _abstract_eval(q, kv, indices, q_start, row_ranges, *, sm_scale, causal, k_stride, lse_base, d_v,
                   deterministic, implementation):
    problem = contract.check_canonical(q, kv, indices, q_start, row_ranges)
    return (jax.core.ShapedArray(problem.canonical_out_shape(d_v), q.dtype),
            jax.core.ShapedArray(problem.canonical_lse_shape, jnp.float32))


def _check_backward_operand(name, x, shape, dtype):
    """``dtype``: the one dtype required; None: any floating dtype."""
    dt = jnp.dtype(x.dtype)
    dtype_ok = jnp.issubdtype(dt, jnp.floating) if dtype is None else dt == jnp.dtype(dtype)
    if tuple(x.shape) != tuple(shape) or not dtype_ok:
        want = "floating-point" if dtype is None else jnp.dtype(dtype).name
        raise ValueError(f"sparse_mla backward: `{name}` must be {want} {list(shape)}, got {dt.name} {list(x.shape)}")


def _bwd_abstract_eval(q, kv, indices, q_start, row_ranges, out, lse, dout, dlse, *, sm_scale, causal, k_stride,
                       lse_base, d_v, deterministic, implementation):
    problem = contract.check_canonical(q, kv, indices, q_start, row_ranges)
    values, heads = problem.canonical_out_shape(d_v), problem.canonical_lse_shape
    _check_backward_operand("out", out, values, q.dtype)
    _check_backward_operand("lse", lse, heads, jnp.float32)
    _check_backward_operand("dout", dout, values, None)
    _check_backward_operand("dlse", dlse, heads, None)
    # dkv in float32: shards' partial sums are added (psum) before the one
    # rounding to kv's dtype (autodiff.py)
    return jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(kv.shape, jnp.float32)


sparse_mla_p = define_primitive("sparse_mla", _abstract_eval, multiple_results=True)
sparse_mla_local_p = define_primitive("sparse_mla_local", _abstract_eval, multiple_results=True)
sparse_mla_bwd_p = define_primitive("sparse_mla_bwd", _bwd_abstract_eval, multiple_results=True)
sparse_mla_bwd_local_p = define_primitive("sparse_mla_bwd_local", _bwd_abstract_eval, multiple_results=True)


def _ffi_forward(q, kv, indices, q_start, row_ranges, *, sm_scale, causal, k_stride, lse_base, d_v, deterministic,
                 implementation):
    """The CUDA kernel through XLA's FFI. Operand order, attribute names and
    attribute types are the C++ handler's contract (csrc/sparse_mla/):
    Buffer<BF16> q [B,S,H,D], Buffer<BF16> kv [B,N,1,D], Buffer<S32>
    indices [B,S,1,T], Buffer<S32> q_start [B], Buffer<S32> row_ranges
    [B,S,3] or [B,S,0]; attrs sm_scale f32, causal bool, k_stride int32,
    lse_base_e bool; results Buffer<BF16> out [B,S,H,d_v], Buffer<F32> lse
    [B,S,H]. (``d_v`` is 512 wherever the kernel is chosen; the forward is
    deterministic in either mode, so ``deterministic`` is not an attribute
    of the forward handler.)"""
    del implementation, deterministic
    B, S, H, _ = q.shape
    out_types = (jax.ShapeDtypeStruct((B, S, H, d_v), jnp.bfloat16), jax.ShapeDtypeStruct((B, S, H), jnp.float32))
    out, lse = jax.ffi.ffi_call(contract.FFI_TARGET, out_types)(
        q, kv, indices, q_start, row_ranges,
        **contract.ffi_attributes(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base))
    return out, lse


def _ffi_backward(q, kv, indices, q_start, row_ranges, out, lse, dout, dlse, *, sm_scale, causal, k_stride,
                  lse_base, d_v, deterministic, implementation):
    """The SM90 backward kernel through XLA's FFI (csrc/sparse_mla/): operands
    Buffer<BF16> q [B,S,H,D], Buffer<BF16> kv [B,N,1,D], Buffer<S32> indices
    [B,S,1,T], Buffer<S32> q_start [B], Buffer<S32> row_ranges [B,S,3] or
    [B,S,0], Buffer<BF16> out [B,S,H,512], Buffer<F32> lse [B,S,H],
    Buffer<BF16> dout [B,S,H,512], Buffer<F32> dlse [B,S,H]; attrs sm_scale
    f32, causal bool, k_stride int32, lse_base_e bool, deterministic bool;
    results Buffer<BF16> dq [B,S,H,D], Buffer<F32> dkv [B,N,1,D] and
    Buffer<U8> workspace
    [``contract.bwd_workspace_bytes``] (XLA allocates it, the handler
    allocates nothing)."""
    del implementation, d_v  # d_v is 512 wherever the kernel is chosen
    workspace = contract.bwd_workspace_bytes(q.shape, kv.shape, deterministic=deterministic)
    dq, dkv, _ = jax.ffi.ffi_call(contract.BWD_FFI_TARGET, (
        jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(kv.shape, jnp.float32),
        jax.ShapeDtypeStruct((workspace,), jnp.uint8),
    ))(*contract.bwd_ffi_operands(q, kv, indices, q_start, row_ranges, out, lse, dout, dlse),
       **contract.ffi_attributes(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base),
       deterministic=bool(deterministic))
    return dq, dkv


def _backward_jnp(q, kv, indices, q_start, row_ranges, out, lse, dout, dlse, **params):
    del out  # the jnp backward recomputes P: it needs lse alone
    return sparse_mla_bwd_canonical(q, kv, indices, q_start, row_ranges, lse, dout, dlse, dkv_dtype=jnp.float32,
                                    **params)


def _out_specs(front):  # out [V, B, S, H, d_v], lse [V, B, S, H]: V, B, S, H as q
    q_spec = dim_specs(front[0])
    return (P(*q_spec[:4], None), P(*q_spec[:4]))


def _bwd_out_specs(front):  # dq, dkv: as q and kv
    return P(*dim_specs(front[0])), P(*dim_specs(front[1]))


ext.declare_ffi_targets(contract.FFI_TARGET, contract.FFI_TEST_TARGET, contract.BWD_FFI_TARGET,
                        contract.BWD_FFI_TEST_TARGET, contract.BWD_BOUND_FFI_TARGET, contract.BWD_FIXED_FFI_TARGET)
register_platform_lowerings(
    sparse_mla_local_p, who="sparse_mla", check=contract.check_canonical, supports=contract.kernel_supports,
    supports_params=("d_v",), jnp_impl=reference_canonical, kernel_impl=_ffi_forward, multiple_results=True,
)
register_platform_lowerings(
    sparse_mla_bwd_local_p, who="sparse_mla backward", check=lambda *avals: contract.check_canonical(*avals[:5]),
    supports=contract.bwd_kernel_supports, supports_params=("d_v",), jnp_impl=_backward_jnp,
    kernel_impl=_ffi_backward, multiple_results=True,
)
register_partitioned_lowering(sparse_mla_p, sparse_mla_local_p, PARTITIONING)
register_partitioned_lowering(sparse_mla_bwd_p, sparse_mla_bwd_local_p, BWD_PARTITIONING)
register_batching(sparse_mla_p, _out_specs)
register_batching(sparse_mla_bwd_p, _bwd_out_specs)
