"""attn_dist's public function (SPEC §2, with SPEC §6's packed sequences and
per-row top-k lengths).

It validates its arguments at trace time (``contract``), adds B = 1 when the
inputs are unbatched, binds the logical primitive through its custom VJP
(``autodiff``) and squeezes back. SPEC §6's keywords become per-row ranges
(``_core/packing.py``), an operand of the primitive.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..._core import checks, packing
from ..._core.checks import canonicalize
from ..._core.primitives import require_kernel
from . import contract
from .autodiff import attn_dist_canonical


def attn_dist(
    q, k, indices, lse, *, sm_scale, lse_base=None, causal=True, q_start_index=0, k_stride=1,
    implementation=None, topk_length=None, cu_seqlens_q=None, cu_seqlens_k=None,
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
      lse_base: the base of ``lse``, required: ``"e"`` for a natural-log lse
        (FlashMLA, cuDNN, TileLang's finetune kernels) or ``"2"`` for a
        log2-sum-exp2 lse (TileLang's ``sparse_mla_fwd``).
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
    problem = contract.check_problem(q, k, indices, lse)
    params = contract.check_params(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base)
    implementation = checks.check_implementation(implementation, "attn_dist")
    packed = packing.check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, "attn_dist")
    if implementation == "cuda":
        require_kernel("attn_dist", *contract.kernel_supports(problem))
    if problem.is_empty:
        return jnp.zeros(problem.out_shape, jnp.float32)
    q_start_index, ranges, params = packing.rule_operands(problem, packed, params)
    args = canonicalize(problem, q, k, indices, lse, q_start_index)
    out = attn_dist_canonical(*args, ranges, implementation=implementation, **params.as_dict())
    return out if problem.batched else out[0]
