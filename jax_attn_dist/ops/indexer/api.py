"""The indexer's public functions: ``indexer_kl`` (SPEC §5.2) and
``indexer_loss`` (SPEC §5.4, the target from attn_dist then ``indexer_kl``),
both with SPEC §6's packed sequences and per-row top-k lengths.

Each validates its arguments at trace time (``contract``), adds B = 1 when
the inputs are unbatched, binds the logical primitives through their custom
VJPs (``autodiff``) and squeezes back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..._core import checks, packing
from ..._core.checks import canonicalize
from ..._core.primitives import require_kernel
from ..attn_dist import contract as attn_contract
from ..attn_dist.autodiff import attn_dist_canonical
from . import contract
from .autodiff import indexer_kl_canonical
from .reference import target_from_dist


def indexer_kl(
    index_q, index_k, weights, indices, target, *, scale=1.0, causal=True, q_start_index=0, k_stride=1,
    deterministic=False, implementation=None, topk_length=None, cu_seqlens_q=None, cu_seqlens_k=None,
):
    """The lightning indexer's KL loss per query row (SPEC §5).

    For row ``s`` and slot ``j`` with ``i = indices[s, 0, j]`` and
    ``valid(s, j)`` the rule of :func:`attn_dist`::

        z(s, h, j)  = dot(index_q[s, h], index_k[i])        # bf16 products, f32 sum
        logit(s, j) = scale * sum_h weights[s, h] * relu(z(s, h, j))
        log_p(s, j) = logit(s, j) - logsumexp over valid j' of logit(s, j')
        t(s, j)     = target[s, j] if valid(s, j) and target[s, j] > 0 else 0
        kl(s)       = sum_j t(s, j) * (log t(s, j) - log_p(s, j))

    A row with no valid slot, or no positive target on a valid slot, gives
    exactly 0 (and zero gradients). The target is used as given (not
    renormalised).

    Args:
      index_q: ``[B?, S, HI, DI]`` bfloat16 (float16/float32 on the XLA path).
      index_k: ``[B?, N, DI]``, dtype of ``index_q``.
      weights: ``[B?, S, HI]`` float32 or bfloat16 (used in float32).
      indices: ``[B?, S, 1, T]`` int32, any values (as ``attn_dist`` takes them).
      target: ``[B?, S, T]`` float32, the teacher distribution (e.g. the
        normalised ``attn_dist`` mass; see :func:`indexer_loss`).
      scale: multiplies the logits (finite float > 0, static).
      causal, q_start_index, k_stride: the validity rule, as in ``attn_dist``.
      deterministic: make every gradient bitwise reproducible run to run
        (``d index_k`` summed in a fixed order); the forward, ``d index_q``
        and ``d weights`` are deterministic either way.
      implementation: ``None`` (the CUDA kernel where it applies when lowered
        for CUDA, else XLA), ``"cuda"`` (raise if the forward kernel cannot
        serve the call) or ``"xla"``.
      topk_length, cu_seqlens_q, cu_seqlens_k: SPEC §6, as in
        :func:`attn_dist` (they restrict ``valid(s, j)``; rows of no
        sequence give 0).

    Returns:
      float32 ``[B?, S]``: the per-row KL; mask and reduce it as you need.

    Differentiable w.r.t. index_q, index_k and weights (SPEC §5.3); ``target``
    gets a zero cotangent (it is the stop-gradient teacher).
    """
    problem = contract.check_problem(index_q, index_k, weights, indices, target)
    params = contract.check_params(scale=scale, causal=causal, k_stride=k_stride, deterministic=deterministic)
    implementation = checks.check_implementation(implementation, "indexer_kl")
    packed = packing.check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, "indexer_kl")
    if implementation == "cuda":
        require_kernel("indexer_kl", *contract.kernel_supports(problem))
    if problem.is_empty:
        return jnp.zeros(problem.out_shape, jnp.float32)
    q_start_index, ranges, params = packing.rule_operands(problem, packed, params)
    args = canonicalize(problem, index_q, index_k, weights, indices, target, q_start_index)
    kl = indexer_kl_canonical(*args, ranges, implementation=implementation, **params.as_dict())
    return kl if problem.batched else kl[0]


def indexer_loss(
    q, k, lse, index_q, index_k, weights, indices, *, sm_scale, lse_base=None, causal=True, q_start_index=0,
    k_stride=1, scale=1.0, deterministic=False, implementation=None, topk_length=None, cu_seqlens_q=None,
    cu_seqlens_k=None,
):
    """The whole DSA indexer loss per query row (SPEC §5.4): the target is the
    main attention's mass on each slot, all heads summed and L1-normalised
    over the row's slots (0 where the row's mass is 0), under
    ``stop_gradient``; then :func:`indexer_kl`.

    ``q, k, lse, indices`` are :func:`attn_dist`'s (with HK = 1: one index
    list per query, shared with the indexer); ``index_q, index_k, weights``,
    ``scale`` and ``deterministic`` are :func:`indexer_kl`'s; ``causal``,
    ``q_start_index``, ``k_stride``, ``implementation`` and SPEC §6's
    ``topk_length``, ``cu_seqlens_q``, ``cu_seqlens_k`` apply to both.
    Returns float32 ``[B?, S]``. Gradients flow to index_q, index_k and
    weights only.
    """
    who = "indexer_loss"
    problem = attn_contract.check_problem(q, k, indices, lse, who)
    if problem.HK != 1:
        raise ValueError(f"{who}: `k` must have one kv head (HK = 1): the indexer shares one index list per "
                         f"query, got HK = {problem.HK}")
    lead = (problem.B,) if problem.batched else ()
    target_spec = jax.ShapeDtypeStruct(lead + (problem.S, problem.T), jnp.float32)
    index_problem = contract.check_problem(index_q, index_k, weights, indices, target_spec, who)
    if index_problem.N != problem.N:
        # Both steps select keys by the same indices, and SPEC §6's row
        # ranges are computed once from N: the two key arrays must agree.
        raise ValueError(f"{who}: `k` and `index_k` must hold the same keys (one row per key, N), got N = "
                         f"{problem.N} from `k` {checks.fmt_shape(k.shape)} and N = {index_problem.N} from "
                         f"`index_k` {checks.fmt_shape(index_k.shape)}")
    attn_params = attn_contract.check_params(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base,
                                         who=who)
    index_params = contract.check_params(scale=scale, causal=causal, k_stride=k_stride,
                                                  deterministic=deterministic, who=who)
    implementation = checks.check_implementation(implementation, who)
    packed = packing.check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, who)
    if implementation == "cuda":
        require_kernel(who, *attn_contract.kernel_supports(problem))
        require_kernel(who, *contract.kernel_supports(index_problem))
    if problem.is_empty or index_problem.is_empty:
        return jnp.zeros(index_problem.out_shape, jnp.float32)

    # SPEC §6 once, for both steps.
    q_start_index, ranges, attn_params, index_params = packing.rule_operands(problem, packed, attn_params, index_params)
    q, k, indices, lse, q_start = canonicalize(problem, q, k, indices, lse, q_start_index)
    dist = attn_dist_canonical(q, k, indices, lse, q_start, ranges, implementation=implementation,
                               **attn_params.as_dict())                                    # [B, G, S, T]
    target = target_from_dist(dist)
    index_q, index_k, weights, _ = canonicalize(index_problem, index_q, index_k, weights, 0)
    kl = indexer_kl_canonical(index_q, index_k, weights, indices, target, q_start, ranges,
                              implementation=implementation, **index_params.as_dict())
    return kl if problem.batched else kl[0]
