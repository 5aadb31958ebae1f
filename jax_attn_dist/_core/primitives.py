"""The machinery every op's primitives are built with: definition, the
per-platform lowering choice (kernel or jnp path), and the kernel
requirement the public functions share.

Two layers per op (each op's ``primitive`` module defines them):

* The outer, logical primitive always sees canonical, batched operands (for
  attn_dist: q [B,S,H,D], k [B,N,HK,D], indices [B,S,HK,T] int32,
  lse [B,S,H] float32, q_start [B] int32, row_ranges [B,S,3] int32 or
  [B,S,0], see ``_contract.ROW_RANGE_FIELDS``) and static, checked
  parameters.
  Transformation rules (vmap through ``batching.py``, sharding through
  ``partitioning.py``; the op's custom VJP wraps the binds) belong to it.
* Its lowering is a ``custom_partitioning`` function (``partitioning.py``):
  under a multi-device sharding each shard binds the inner primitive (same
  operands and parameters) on its block, with q_start moved by the shard's
  offset when S is sharded; on one device, or in a ``shard_map``, the inner
  primitive sees the operands as they are.
* The inner primitive's lowering picks the implementation per platform: on
  every platform the jnp path (``mlir.lower_fun``); on CUDA, where the kernel
  applies, a ``jax.ffi.ffi_call`` to the extension's FFI target.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import ext


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params: Tuple[Tuple[str, object], ...]):
    kwargs = dict(params)
    return jax.jit(lambda *args: prim.bind(*args, **kwargs))


def define_primitive(name: str, abstract_eval: Callable, multiple_results: bool) -> Primitive:
    """A primitive whose eager use compiles it alone (through its lowering)."""
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_abstract_eval(abstract_eval)
    prim.def_impl(lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args))
    return prim


def _platforms(ctx) -> str:
    platforms = getattr(getattr(ctx, "module_context", None), "platforms", None)
    return ", ".join(platforms) if platforms else "a non-CUDA platform"


def local_cuda_backend() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def kernel_serves_shards(mesh, problem, supports: Callable, implementation: Optional[str]) -> bool:
    """Whether each shard of a partitioned call on ``mesh`` runs the CUDA
    kernel: every device of the mesh a local CUDA device (a ROCm GPU, also
    platform "gpu", is not), and ``kernel_decision`` says so for the
    shard's ``problem``."""
    devices = getattr(mesh, "devices", None)
    if devices is None or not devices.size:
        return False
    try:
        cuda = set(jax.devices("cuda"))
    except RuntimeError:
        return False
    return all(d in cuda for d in devices.flat) and kernel_decision(problem, supports, implementation)[0]


def kernel_decision(problem, supports: Callable, implementation: Optional[str]) -> Tuple[bool, str]:
    """Whether the CUDA lowering of ``problem`` calls its kernel, and why.

    The kernel is used when ``implementation != "xla"``, the problem is not
    empty and ``supports(problem)``. Lowering itself does not need the
    compiled extension (a CPU-only process can lower for CUDA, e.g. to
    export), except in a process that has a CUDA backend but no registered
    kernel: there the XLA path is used, since the custom call could not run
    (``implementation="cuda"`` raises instead).
    """
    if implementation == "xla":
        return False, "implementation='xla'"
    if problem.is_empty:
        return False, "empty problem (all zeros)"
    ok, why = supports(problem)
    if not ok:
        return False, why
    if not ext.extension_registered(required=implementation == "cuda") and local_cuda_backend():
        return False, ext.kernel_unavailable_reason()
    return True, "cuda kernel"


def register_platform_lowerings(local_p: Primitive, *, who: str, check: Callable, supports: Callable,
                                jnp_impl: Callable, kernel_impl: Optional[Callable], multiple_results: bool,
                                supports_params: Tuple[str, ...] = ()):
    """Lowerings of an inner primitive: the jnp path everywhere; on CUDA the
    kernel (``kernel_impl``) where ``kernel_decision`` says so.
    ``implementation="cuda"`` raises where the kernel cannot be used.
    ``supports_params``: the primitive's parameters that ``supports`` also
    takes, as keywords."""
    lower_jnp = mlir.lower_fun(jnp_impl, multiple_results=multiple_results)
    lower_kernel = mlir.lower_fun(kernel_impl, multiple_results=multiple_results) if kernel_impl else None

    def lowering_default(ctx, *args, **params):
        if params["implementation"] == "cuda":
            raise ValueError(
                f"{who}: implementation='cuda' needs a CUDA device; lowering for {_platforms(ctx)}. "
                "Use implementation=None (kernel where it applies) or 'xla'."
            )
        return lower_jnp(ctx, *args, **params)

    def lowering_cuda(ctx, *args, **params):
        problem = check(*ctx.avals_in)
        implementation = params["implementation"]
        kw = {name: params[name] for name in supports_params}
        use_kernel, why = kernel_decision(problem, lambda pr: supports(pr, **kw), implementation)
        if use_kernel and lower_kernel is not None:
            ext.ensure_registered()
            return lower_kernel(ctx, *args, **params)
        if implementation == "cuda" and not problem.is_empty:
            raise ValueError(f"{who}: implementation='cuda' cannot be used: {why}")
        return lower_jnp(ctx, *args, **params)

    mlir.register_lowering(local_p, lowering_default)
    mlir.register_lowering(local_p, lowering_cuda, platform="cuda")


def require_kernel(who: str, supported: bool, why: str) -> None:
    """``implementation="cuda"``: raise now, clearly, if the kernel cannot
    serve the call (a registration error is raised, never swallowed)."""
    if not supported:
        raise ValueError(f"{who}: implementation='cuda' cannot serve this call: {why}. "
                         "Use implementation=None or 'xla' for the XLA path.")
    if not ext.extension_registered(required=True):
        raise RuntimeError(f"{who}: implementation='cuda' but the CUDA kernel is not available: "
                           f"{ext.kernel_unavailable_reason()}")
