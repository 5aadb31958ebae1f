"""The public functions: ``attn_dist`` (SPEC §2), ``indexer_kl`` and
``indexer_loss`` (SPEC §5), all three with SPEC §6's packed sequences and
per-row top-k lengths.

Each validates its arguments at trace time (``_contract``), adds B = 1 when
the inputs are unbatched, binds its logical primitive through its custom VJP
(``autodiff``), and squeezes back. Importing this module registers the vmap
rules (``batching``) and, through the primitives, the sharding rules
(``sharding``). SPEC §6's keywords become per-row ranges (``packing``), an
operand of the primitives.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import _contract, _ext, packing
from . import batching, indexer_primitive, primitive, sharding  # noqa: F401  (vmap and sharding rules)
from .autodiff import attn_dist_canonical, indexer_kl_canonical
from .reference import canonicalize


def kernel_available() -> bool:
    """True when the compiled CUDA extension imported and its FFI handlers are
    registered with XLA (it does not check that a GPU is present)."""
    return _ext.kernel_available()


def _rule_operands(problem, packed, *params):
    """``(q_start_index, row_ranges, *params)`` for a canonical call: with §6
    keywords, SPEC §6's per-row ranges (canonical ``[B, S, 3]``), which hold
    the whole rule, ``q_start_index=0`` and each of ``params`` with
    ``causal=False``; else ``[B, S, 0]`` and the caller's rule as given."""
    ranges = packing.row_ranges(packed, S=problem.S, N=problem.N, T=problem.T, causal=params[0].causal,
                                k_stride=params[0].k_stride, batch=problem.B if problem.batched else None)
    if ranges is None:
        return (packed.q_start_index, _contract.no_row_ranges(problem.B, problem.S), *params)
    return (0, ranges if problem.batched else ranges[None], *(dataclasses.replace(p, causal=False) for p in params))


def _require_kernel(who: str, supported, why: str) -> None:
    """``implementation="cuda"``: raise now, clearly, if the kernel cannot
    serve the call (a registration error is raised, never swallowed)."""
    if not supported:
        raise ValueError(f"{who}: implementation='cuda' cannot serve this call: {why}. "
                         "Use implementation=None or 'xla' for the XLA path.")
    if not _ext.kernel_available(required=True):
        raise RuntimeError(f"{who}: implementation='cuda' but the CUDA kernel is not available: "
                           f"{_ext.kernel_unavailable_reason()}")


def attn_dist(
    q, k, indices, lse, *, sm_scale, causal=True, q_start_index=0, k_stride=1,
    lse_base="2", implementation=None, topk_length=None, cu_seqlens_q=None, cu_seqlens_k=None,
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
      topk_length: optional int32 ``[B?, S]`` (may be traced): slot ``j`` of
        row ``s`` is valid only if ``j < clamp(topk_length[s], 0, T)``
        (SPEC §6.1).
      cu_seqlens_q, cu_seqlens_k: optional int32 ``[num_seqs + 1]`` (values
        may be traced), given together and only with unbatched inputs:
        packed sequences (SPEC §6.2). Row ``s`` of sequence ``b``
        (``cu_seqlens_q[b] <= s < cu_seqlens_q[b + 1]``) sees only keys
        ``cu_seqlens_k[b] <= i < cu_seqlens_k[b + 1]`` (indices are absolute
        rows of ``k``), causally relative to its sequence; ``q_start_index``
        is then an int or an int32 ``[num_seqs]`` array (each sequence's
        first query position). Padding rows and rows touched by malformed
        boundaries (SPEC §6.3) give 0. See
        :func:`cu_seqlens_from_segment_ids`.

    Returns:
      float32 ``[B?, G, S, T]`` with ``G = ceil(H / 64)``.

    Differentiable w.r.t. q, k and lse (SPEC §2.6). Every array has the
    leading batch dimension B, or none does. Errors in shapes, dtypes or
    parameters raise ``TypeError``/``ValueError`` at trace time, naming the
    argument.
    """
    problem = _contract.check_problem(q, k, indices, lse)
    params = _contract.check_params(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base)
    implementation = _contract.check_implementation(implementation)
    packed = _contract.check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem)
    if implementation == "cuda":
        _require_kernel("attn_dist", *_contract.kernel_supports(problem))
    if problem.is_empty:
        return jnp.zeros(problem.out_shape, jnp.float32)
    q_start_index, ranges, params = _rule_operands(problem, packed, params)
    args = canonicalize(problem, q, k, indices, lse, q_start_index)
    out = attn_dist_canonical(*args, ranges, implementation=implementation, **params.as_dict())
    return out if problem.batched else out[0]


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
    problem = _contract.check_indexer_problem(index_q, index_k, weights, indices, target)
    params = _contract.check_indexer_params(scale=scale, causal=causal, k_stride=k_stride,
                                            deterministic=deterministic)
    implementation = _contract.check_implementation(implementation, "indexer_kl")
    packed = _contract.check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, "indexer_kl")
    if implementation == "cuda":
        _require_kernel("indexer_kl", *_contract.indexer_kernel_supports(problem))
    if problem.is_empty:
        return jnp.zeros(problem.out_shape, jnp.float32)
    q_start_index, ranges, params = _rule_operands(problem, packed, params)
    args = canonicalize(problem, index_q, index_k, weights, indices, target, q_start_index)
    kl = indexer_kl_canonical(*args, ranges, implementation=implementation, **params.as_dict())
    return kl if problem.batched else kl[0]


def indexer_loss(
    q, k, lse, index_q, index_k, weights, indices, *, sm_scale, lse_base="2", causal=True, q_start_index=0,
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
    problem = _contract.check_problem(q, k, indices, lse, who)
    if problem.HK != 1:
        raise ValueError(f"{who}: `k` must have one kv head (HK = 1): the indexer shares one index list per "
                         f"query, got HK = {problem.HK}")
    lead = (problem.B,) if problem.batched else ()
    target_spec = jax.ShapeDtypeStruct(lead + (problem.S, problem.T), jnp.float32)
    index_problem = _contract.check_indexer_problem(index_q, index_k, weights, indices, target_spec, who)
    attn_params = _contract.check_params(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base,
                                         who=who)
    index_params = _contract.check_indexer_params(scale=scale, causal=causal, k_stride=k_stride,
                                                  deterministic=deterministic, who=who)
    implementation = _contract.check_implementation(implementation, who)
    packed = _contract.check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, who)
    if implementation == "cuda":
        _require_kernel(who, *_contract.kernel_supports(problem))
        _require_kernel(who, *_contract.indexer_kernel_supports(index_problem))
    if problem.is_empty or index_problem.is_empty:
        return jnp.zeros(index_problem.out_shape, jnp.float32)

    # SPEC §6 once, for both steps.
    q_start_index, ranges, attn_params, index_params = _rule_operands(problem, packed, attn_params, index_params)
    q, k, indices, lse, q_start = canonicalize(problem, q, k, indices, lse, q_start_index)
    dist = attn_dist_canonical(q, k, indices, lse, q_start, ranges, implementation=implementation,
                               **attn_params.as_dict())                                    # [B, G, S, T]
    mass = dist.sum(axis=1)                                                                # [B, S, T]
    total = mass.sum(axis=-1, keepdims=True)
    target = jax.lax.stop_gradient(jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), 0.0))
    index_q, index_k, weights, _ = canonicalize(index_problem, index_q, index_k, weights, 0)
    kl = indexer_kl_canonical(index_q, index_k, weights, indices, target, q_start, ranges,
                              implementation=implementation, **index_params.as_dict())
    return kl if problem.batched else kl[0]
