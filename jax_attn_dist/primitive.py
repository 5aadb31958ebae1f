"""``attn_dist``: the public function and its logical primitive.

Two layers:

* The outer, logical primitive ``attn_dist_p`` always sees canonical, batched
  operands -- q [B,S,H,D], k [B,N,HK,D], indices [B,S,HK,T] int32,
  lse [B,S,H] float32, q_start [B] int32 -- and static parameters
  ``sm_scale`` (float), ``causal`` (bool), ``k_stride`` (int), ``lse_base``
  ("2"/"e") and ``implementation`` (None/"cuda"/"xla"). Transformation rules
  (vmap, autodiff, sharding) belong on this primitive.
* Its lowering is a ``custom_partitioning`` function (``sharding.py``): under
  a multi-device sharding, each shard binds the inner primitive
  ``attn_dist_local_p`` (same operands and parameters) on its block, with
  q_start moved by the shard's offset when S is sharded; on one device, or in
  a ``shard_map``, the inner primitive sees the operands as they are.
* The inner primitive's lowering picks the implementation per platform: on
  every platform the jnp reference (``mlir.lower_fun``); on CUDA, where the
  kernel applies, a ``jax.ffi.ffi_call`` to the ``jax_attn_dist_fwd`` FFI
  target.

The public :func:`attn_dist` validates, adds B = 1 when the inputs are
unbatched, binds, and squeezes back.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _contract, _ext, sharding
from ._contract import FFI_TARGET, Problem
from .reference import canonicalize, reference_canonical

attn_dist_p = Primitive("attn_dist")
attn_dist_p.multiple_results = False

#: The per-shard (per-device) primitive: same operands and parameters; its
#: lowering is the kernel-or-reference choice. Only the partitioned lowering
#: of ``attn_dist_p`` binds it.
attn_dist_local_p = Primitive("attn_dist_local")
attn_dist_local_p.multiple_results = False



# ----------------------------------------------------------------------------
# abstract evaluation and eager implementation
# ----------------------------------------------------------------------------


def _abstract_eval(q, k, indices, lse, q_start, *, sm_scale, causal, k_stride, lse_base, implementation):
    problem = _contract.check_canonical(q, k, indices, lse, q_start)
    return jax.core.ShapedArray(problem.canonical_out_shape, jnp.float32)


attn_dist_p.def_abstract_eval(_abstract_eval)
attn_dist_local_p.def_abstract_eval(_abstract_eval)


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params: Tuple[Tuple[str, object], ...]):
    kwargs = dict(params)
    return jax.jit(lambda *args: prim.bind(*args, **kwargs))


def _impl(*args, **params):
    # Eager use: compile the primitive alone (through its lowering) and run it.
    return _jitted_bind(attn_dist_p, tuple(sorted(params.items())))(*args)


def _local_impl(*args, **params):
    return _jitted_bind(attn_dist_local_p, tuple(sorted(params.items())))(*args)


attn_dist_p.def_impl(_impl)
attn_dist_local_p.def_impl(_local_impl)


# ----------------------------------------------------------------------------
# lowering
# ----------------------------------------------------------------------------


def _ffi_forward(q, k, indices, lse, q_start, *, sm_scale, causal, k_stride, lse_base, implementation):
    """The CUDA kernel through XLA's FFI. Operand order, attribute names and
    attribute types are the C++ handler's contract: Buffer<BF16> q [B,S,H,D],
    Buffer<BF16> k [B,N,1,D], Buffer<S32> indices [B,S,1,T], Buffer<F32> lse
    [B,S,H], Buffer<S32> q_start [B]; attrs sm_scale f32, causal bool,
    k_stride int32, lse_base_e bool; result Buffer<F32> [B,G,S,T]."""
    B, S, H, _ = q.shape
    T = indices.shape[-1]
    out_type = jax.ShapeDtypeStruct((B, _contract.num_groups(H), S, T), jnp.float32)
    return jax.ffi.ffi_call(FFI_TARGET, out_type)(
        q, k, indices, lse, q_start,
        sm_scale=np.float32(sm_scale),
        causal=bool(causal),
        k_stride=np.int32(k_stride),
        lse_base_e=bool(lse_base == "e"),
    )


_reference_lowering = mlir.lower_fun(reference_canonical, multiple_results=False)
_kernel_lowering = mlir.lower_fun(_ffi_forward, multiple_results=False)


def _platforms(ctx) -> str:
    platforms = getattr(getattr(ctx, "module_context", None), "platforms", None)
    return ", ".join(platforms) if platforms else "a non-CUDA platform"


def _lowering_default(ctx, *args, **params):
    if params["implementation"] == "cuda":
        raise ValueError(
            "attn_dist: implementation='cuda' needs a CUDA device; lowering for "
            f"{_platforms(ctx)}. Use implementation=None (kernel where it applies) "
            "or 'xla'."
        )
    return _reference_lowering(ctx, *args, **params)


def _local_cuda_backend() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def kernel_decision(problem: Problem, implementation: Optional[str]) -> Tuple[bool, str]:
    """Whether the CUDA lowering of this problem calls the kernel, and why.

    The kernel is used when ``implementation != "xla"``, the problem is not
    empty and ``kernel_supports(problem)``. Lowering itself does not need the
    compiled extension (a CPU-only process can lower for CUDA, e.g. to export),
    except in a process that has a CUDA backend but no registered kernel: there
    the XLA path is used, since the custom call could not run.
    """
    if implementation == "xla":
        return False, "implementation='xla'"
    if problem.is_empty:
        return False, "empty problem (all zeros)"
    ok, why = _contract.kernel_supports(problem)
    if not ok:
        return False, why
    if not _ext.kernel_available() and _local_cuda_backend():
        return False, _ext.kernel_unavailable_reason()
    return True, "cuda kernel"


def _lowering_cuda(ctx, *args, **params):
    problem = _contract.check_canonical(*ctx.avals_in)
    implementation = params["implementation"]
    use_kernel, why = kernel_decision(problem, implementation)
    if use_kernel:
        _ext.ensure_registered()
        return _kernel_lowering(ctx, *args, **params)
    if implementation == "cuda" and not problem.is_empty:
        raise ValueError(f"attn_dist: implementation='cuda' cannot be used: {why}")
    return _reference_lowering(ctx, *args, **params)


mlir.register_lowering(attn_dist_local_p, _lowering_default)
mlir.register_lowering(attn_dist_local_p, _lowering_cuda, platform="cuda")

# The outer primitive lowers through the custom_partitioning function that
# binds the inner one per shard (see sharding.py).
sharding.register_partitioned_lowering(attn_dist_p, attn_dist_local_p)


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def kernel_available() -> bool:
    """True when the compiled CUDA extension imported and its FFI handler is
    registered with XLA (it does not check that a GPU is present)."""
    return _ext.kernel_available()


def attn_dist(
    q, k, indices, lse, *, sm_scale, causal=True, q_start_index=0, k_stride=1,
    lse_base="2", implementation=None,
):
    """Per-head-group attention probabilities on the top-k keys (SPEC §2).

    For query row ``s``, head ``h``, slot ``j``::

        kh    = h // (H // HK)                  # the kv head of head h
        i     = indices[s, kh, j]
        valid = 0 <= i < N and (not causal or
                i <= floor((q_start_index + s + 1 - k_stride) / k_stride))
        z     = sm_scale * dot(q[s, h], k[i, kh])     # bf16 products, f32 sum
        p     = exp(z - lse_e[s, h])                  # 0 where not valid, or
                                                      # lse[s, h] not finite
        out[g, s, j] = sum of p over heads 64g .. min(64g + 64, H) - 1

    with ``lse_e = lse`` (``lse_base="e"``) or ``lse * ln 2`` (``lse_base="2"``,
    i.e. ``p = exp2(z * log2(e) - lse)``). Duplicated indices are not merged.
    Any index value is safe (out-of-range ones give 0, nothing reads out of
    bounds). With an ``lse`` that is the log-sum-exp of the same valid set,
    each head's probabilities sum to 1 over j.

    HK > 1 is a grouped-query generalisation of the MLA form (HK = 1, where
    ``indices[s, 0, j]`` serves every head): each kv head has its own top-k
    list. The CUDA kernel serves HK = 1 only; other HK use the XLA path.

    Args:
      q: ``[B?, S, H, D]`` bfloat16 (float16/float32 on the XLA path).
      k: ``[B?, N, HK, D]``, dtype of ``q``; ``H % HK == 0``.
      indices: ``[B?, S, HK, T]`` int32, any values.
      lse: ``[B?, S, H]`` float32, the forward's per-head log-sum-exp.
      sm_scale: the forward's softmax scale (finite positive float, static).
      causal: apply the causal rule above.
      q_start_index: absolute position of query row 0: a Python int, or an
        integer array (cast to int32) of shape ``[]`` or, batched, ``[B]``;
        may be traced.
      k_stride: compression stride of the keys (int >= 1, static).
      lse_base: ``"2"`` (log2-sum-exp2, the default) or ``"e"``.
      implementation: ``None`` (the CUDA kernel where it applies when lowered
        for CUDA, else XLA), ``"cuda"`` (raise if the kernel cannot serve the
        call) or ``"xla"`` (the jnp reference).

    Returns:
      float32 ``[B?, G, S, T]`` with ``G = ceil(H / 64)``.

    Every array has the leading batch dimension B, or none does. Errors in
    shapes, dtypes or parameters raise ``TypeError``/``ValueError`` at trace
    time, naming the argument.
    """
    problem = _contract.check_problem(q, k, indices, lse)
    params = _contract.check_params(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base)
    implementation = _contract.check_implementation(implementation)
    q_start_index = _contract.check_q_start_index(q_start_index, problem)

    if implementation == "cuda":
        ok, why = _contract.kernel_supports(problem)
        if not ok:
            raise ValueError(
                f"attn_dist: implementation='cuda' cannot serve this call: {why}. "
                "Use implementation=None or 'xla' for the XLA path."
            )
        if not _ext.kernel_available():
            raise RuntimeError(
                "attn_dist: implementation='cuda' but the CUDA kernel is not available: "
                f"{_ext.kernel_unavailable_reason()}"
            )

    if problem.is_empty:
        return jnp.zeros(problem.out_shape, jnp.float32)

    args = canonicalize(problem, q, k, indices, lse, q_start_index)
    from .autodiff import attn_dist_canonical  # custom VJP around attn_dist_p.bind (autodiff imports this module)
    out = attn_dist_canonical(*args, implementation=implementation, **params.as_dict())
    return out if problem.batched else out[0]
