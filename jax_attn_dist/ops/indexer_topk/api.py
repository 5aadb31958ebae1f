"""indexer_topk's public function (SPEC §9, with SPEC §6's packed
sequences).

It validates its arguments at trace time (``contract``), adds B = 1 when the
inputs are unbatched, turns SPEC §6's keywords into per-row ranges
(``_core/packing.py``), binds the logical primitive on detached operands
(``autodiff``: no gradient) and squeezes back.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..._core import checks, packing
from ..._core.checks import canonicalize
from ..._core.primitives import require_kernel
from . import contract
from .autodiff import indexer_topk_canonical


def indexer_topk(
    index_q, index_k, weights, *, topk, scale=1.0, causal=True, q_start_index=0, k_stride=1, cu_seqlens_q=None,
    cu_seqlens_k=None, index_k_scale=None, implementation=None,
):
    """The lightning indexer's top-k key selection per query row (SPEC §9).

    For row ``s`` and every key ``n`` valid for it (``0 <= n < N``, and if
    ``causal``, ``n <= floor((q_start_index + s + 1 - k_stride) / k_stride)``;
    with cu_seqlens, only the row's own sequence, SPEC §6)::

        logit(s, n) = scale * sum_h weights[s, h]
                              * relu(dot(index_q[s, h], index_k[n]) * index_k_scale[n])

    The row's result holds the ``topk`` valid keys with the largest logits
    (ties at the cut broken towards the smaller key index) in ascending key
    order, then -1 where the row has fewer than ``topk`` valid keys.
    Deterministic; no gradient (the indices are integers; the float inputs
    get zero cotangents).

    Args:
      index_q: ``[B?, S, HI, DI]`` bfloat16 (float16, float32 and
        float8_e4m3fn on the XLA path).
      index_k: ``[B?, N, DI]``, dtype of ``index_q``.
      weights: ``[B?, S, HI]`` float32 or bfloat16 (used in float32). With
        float8 inputs, fold the query scales into them.
      topk: keys kept per row (Python int >= 1, static; may exceed N).
      scale: multiplies the logits (finite float > 0, static).
      causal, q_start_index, k_stride: the validity rule, as in
        :func:`attn_dist` (``q_start_index`` may be traced, ``[B]`` when
        batched).
      cu_seqlens_q, cu_seqlens_k: packed sequences (SPEC §6.2), unbatched
        inputs only; ``q_start_index`` is then an int or ``[num_seqs]``.
      index_k_scale: ``[B?, N]`` float32, each key's scale (multiplies its
        dot products inside the relu); required for float8 inputs, ones
        when omitted.
      implementation: ``None`` (the CUDA kernel where it applies when
        lowered for CUDA, else XLA), ``"cuda"`` (raise if the kernel cannot
        serve the call) or ``"xla"``.

    Returns:
      int32 ``[B?, S, 1, topk]``: the ``indices`` operand of
      :func:`attn_dist`, :func:`indexer_kl` and sparse MLA.
    """
    who = "indexer_topk"
    problem = contract.check_problem(index_q, index_k, weights, index_k_scale, who)
    params = contract.check_params(topk=topk, scale=scale, causal=causal, k_stride=k_stride, who=who)
    problem = dataclasses.replace(problem, T=params.topk)
    implementation = checks.check_implementation(implementation, who)
    packed = packing.check_packing(None, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, who)
    if implementation == "cuda":
        require_kernel(who, *contract.kernel_supports(problem))
    if problem.is_empty:
        return jnp.full(problem.out_shape, -1, jnp.int32)
    if index_k_scale is None:
        index_k_scale = jnp.ones(((problem.B,) if problem.batched else ()) + (problem.N,), jnp.float32)
    q_start_index, ranges, params = packing.rule_operands(problem, packed, params)
    args = canonicalize(problem, index_q, index_k, weights, index_k_scale, q_start_index)
    out = indexer_topk_canonical(*args, ranges, implementation=implementation, **params.as_dict())
    return out if problem.batched else out[0]
