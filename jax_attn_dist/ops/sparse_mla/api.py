"""sparse_mla's public function (SPEC §8, with SPEC §6's packed sequences and
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
from .autodiff import sparse_mla_canonical


def sparse_mla(
    q, kv, indices, *, sm_scale, d_v=contract.KERNEL_D_V, causal=True, q_start_index=0, k_stride=1, lse_base="2",
    topk_length=None, cu_seqlens_q=None, cu_seqlens_k=None, deterministic=False, implementation=None,
):
    """Sparse MLA attention over each query's top-k keys (SPEC §8).

    For query row ``s``, head ``h`` (kv head ``kh = h // (H // HK)``) and
    slot ``j`` with ``i = indices[s, kh, j]`` and ``valid(s, j)`` the rule of
    :func:`attn_dist` (SPEC §2, restricted by SPEC §6's keywords)::

        score(s, h, j) = sm_scale * dot(q[s, h], kv[i, kh])     # input-dtype products, f32 sum
        lse_e[s, h]    = log sum over valid j of exp(score)
        out[s, h]      = sum over valid j of exp(score - lse_e) * kv[i, kh, :d_v]

    Every slot counts, duplicates included. A row with no valid slot gives
    ``out = 0`` and ``lse = -inf``. ``lse`` is returned in base ``lse_base``
    (``lse_2 = lse_e * log2(e)``): pass the same base to :func:`attn_dist`.

    Args:
      q: ``[B?, S, H, D]`` bfloat16 (float16/float32 on the XLA path).
      kv: ``[B?, N, HK, D]``, dtype of ``q``: the MLA latent (HK = 1), the
        ``k`` attn_dist takes; its first ``d_v`` features are the values.
      indices: ``[B?, S, HK, T]`` int32, any values.
      sm_scale: softmax scale (finite positive float, static).
      d_v: value width (static int, ``1 <= d_v <= D``; the kernel: 512).
      causal, q_start_index, k_stride: the validity rule, as in
        :func:`attn_dist` (``q_start_index`` may be traced; batched: ``[B]``).
      lse_base: ``"2"`` (default, log2-sum-exp2) or ``"e"``: the base of the
        returned ``lse``.
      topk_length, cu_seqlens_q, cu_seqlens_k: SPEC §6, as in
        :func:`attn_dist`.
      deterministic: bitwise-reproducible gradients (the kv gradient summed
        in a fixed order); the forward is deterministic either way.
      implementation: ``None`` (the CUDA kernel where it applies when lowered
        for CUDA, else XLA), ``"cuda"`` (raise if the kernel cannot serve the
        call) or ``"xla"`` (the jnp reference).

    Returns:
      ``(out, lse)``: ``out`` ``[B?, S, H, d_v]`` in q's dtype, ``lse``
      float32 ``[B?, S, H]``.

    Differentiable w.r.t. q and kv, from the cotangents of both ``out`` and
    ``lse`` (SPEC §8.3). Every array has the leading batch dimension B, or
    none does. Errors in shapes, dtypes or parameters raise
    ``TypeError``/``ValueError`` at trace time, naming the argument.
    """
    who = "sparse_mla"
    problem = contract.check_problem(q, kv, indices, who)
    params = contract.check_params(problem, sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base,
                                   d_v=d_v, deterministic=deterministic, who=who)
    implementation = checks.check_implementation(implementation, who)
    packed = packing.check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, who)
    if implementation == "cuda":
        require_kernel(who, *contract.kernel_supports(problem, d_v=params.d_v))
    if problem.is_empty:
        return (jnp.zeros(problem.out_shape(params.d_v), q.dtype),
                jnp.full(problem.lse_shape, -jnp.inf, jnp.float32))
    q_start_index, ranges, params = packing.rule_operands(problem, packed, params)
    q, kv, indices, q_start = canonicalize(problem, q, kv, indices, q_start_index)
    out, lse = sparse_mla_canonical(q, kv, indices, q_start, ranges, implementation=implementation,
                                    **params.as_dict())
    return (out, lse) if problem.batched else (out[0], lse[0])
