"""Reverse-mode autodiff of ``attn_dist``: a ``jax.custom_vjp`` around the
canonical bind of ``attn_dist_p``.

With ``G`` the cotangent of ``out[g(h), s, j]`` (``g(h) = h // 64``) and ``p``
the probabilities of SPEC §2 (0 where the slot is invalid or ``lse`` is not
finite)::

    dz(s, h, j)  = G * p(s, h, j) * sm_scale
    dq[s, h]     = sum_j dz(s, h, j) * k[idx(s, kh(h), j), kh(h)]
    dk[i, kh]   += sum_{h of kv head kh} dz(s, h, j) * q[s, h]   for i = idx(s, kh, j)
    dlse[s, h]   = -c * sum_j G * p(s, h, j)     c = 1 (lse_base "e"), ln 2 ("2")

``dk`` is a scatter-add: duplicated indices accumulate, invalid slots add
nothing. ``indices`` and ``q_start`` get no gradient. Where ``p`` is 0 the
gradients are exactly 0 (never NaN), whatever ``lse`` holds there.

The forward saves only its inputs; the backward recomputes ``p`` (no
``[B, S, H, T]`` residual). The backward is jnp, chunked over the B*S query rows
like the reference (temporaries bounded independently of S): per chunk it
gathers the top-k key rows once, recomputes the scores exactly as the
reference forward does (bf16 products, float32 accumulation), and computes the
gradients in float32 (``Precision.HIGHEST``: no TF32 on GPUs). ``dq`` and
``dlse`` are written per chunk, ``dk`` accumulates in float32; results come
back in the input dtypes. Forward-mode (``jax.jvp``) is not provided.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from . import _contract
from ._contract import HEADS_PER_GROUP, Problem
from .reference import (
    _CHUNK_BYTES,
    _chunk_scores,
    _probabilities,
    _row_loop,
    chunk_rows,
)
from .sharding import dim_specs, run_with_auto_axes

LN2 = math.log(2.0)
_HIGHEST = jax.lax.Precision.HIGHEST


def backward_chunk_rows(problem: Problem) -> int:
    """Query rows per backward chunk (>= 1): ``reference.chunk_rows`` with this
    module's byte budget (tests lower it) and the backward's larger per-row
    temporaries (gathered keys in their dtype and in float32, their float32 dk
    contribution, and about six float32 [H, T] arrays)."""
    itemsize = jnp.dtype(problem.dtype).itemsize
    per_row = (
        problem.HK * problem.T * problem.D * (itemsize + 8)
        + 6 * problem.H * problem.T * 4
        + 2 * problem.H * problem.D * 4
    )
    return chunk_rows(problem, per_row_bytes=per_row, budget=_CHUNK_BYTES)


def attn_dist_bwd_canonical(
    q, k, indices, lse, q_start, g, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, chunk: Optional[int] = None, **unused_params,
):
    """Gradients ``(dq, dk, dlse)`` of ``sum(g * attn_dist(...))`` on canonical
    operands (q [B,S,H,D], k [B,N,HK,D], indices [B,S,HK,T] int32,
    lse [B,S,H] f32, q_start [B] int32; g [B,G,S,T]). ``dq``/``dk`` have the
    dtype of q/k, ``dlse`` is float32. ``chunk`` overrides the rows per chunk."""
    problem = _contract.check_canonical(q, k, indices, lse, q_start)
    B, S, H, D, N, HK, T, G = (
        problem.B, problem.S, problem.H, problem.D, problem.N, problem.HK, problem.T, problem.G,
    )
    if problem.is_empty:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(lse)
    R = B * S
    Hg = H // HK
    C = min(int(chunk), R) if chunk else backward_chunk_rows(problem)

    lse_flat = lse.reshape(R, HK, Hg)
    g_flat = g.astype(jnp.float32).transpose(0, 2, 1, 3).reshape(R, G, T)
    kh = jnp.arange(HK, dtype=jnp.int32)
    c = 1.0 if lse_base == "e" else LN2

    def chunk_grads(start, first_new, dk):
        """dq rows (q dtype) and dlse rows, and ``dk`` plus this chunk's
        scatter-add (rows before ``first_new`` were done by the previous
        chunk: the last chunk may overlap it and adds nothing for them)."""
        lse_rows = jax.lax.dynamic_slice_in_dim(lse_flat, start, C, axis=0)
        g_rows = jax.lax.dynamic_slice_in_dim(g_flat, start, C, axis=0)  # [C, G, T]
        # the forward's scores, recomputed by the reference's own code
        scores = _chunk_scores(q, k, indices, q_start, start, C, problem, causal=causal, k_stride=k_stride)
        valid, idx_c, kg, q_rows, rows = scores.valid, scores.idx_c, scores.kg, scores.q_rows, scores.rows
        p, keep = _probabilities(scores.acc, valid, lse_rows, sm_scale=sm_scale, lse_base=lse_base)

        # G per head: group g(h) = h // 64 of head h = kh * Hg + hh
        g_heads = jnp.repeat(g_rows, HEADS_PER_GROUP, axis=1, total_repeat_length=G * HEADS_PER_GROUP)
        g_heads = g_heads[:, :H].reshape(C, HK, Hg, T)
        gp = jnp.where(keep, g_heads * p, jnp.float32(0.0))  # [C, HK, Hg, T]

        dlse_rows = (gp.sum(axis=-1) * jnp.float32(-c)).reshape(C, H)
        dz = gp * jnp.float32(sm_scale)
        dq_rows = jnp.einsum(
            "rkht,rktd->rkhd", dz, kg.astype(jnp.float32), precision=_HIGHEST,
        ).reshape(C, H, D)

        fresh = rows >= first_new
        dz_new = jnp.where(fresh[:, None, None, None], dz, jnp.float32(0.0))
        dk_rows = jnp.einsum(
            "rkht,rkhd->rktd", dz_new, q_rows.astype(jnp.float32), precision=_HIGHEST,
        )  # [C, HK, T, D]
        target = jnp.where(valid, idx_c, N)  # invalid slots: out of bounds, dropped
        dk = dk.at[scores.b_rows[:, None, None], target, kh[None, :, None]].add(dk_rows, mode="drop")
        return (dq_rows.astype(q.dtype), dlse_rows), dk

    dk0 = jnp.zeros((B, N, HK, D), jnp.float32)
    (dq, dlse), dk = _row_loop(chunk_grads, R, C, [((H, D), q.dtype), ((H,), jnp.float32)], dk0)
    return dq.reshape(B, S, H, D), dk.astype(k.dtype), dlse.reshape(B, S, H)


# ----------------------------------------------------------------------------
# the custom VJP around the primitive
# ----------------------------------------------------------------------------


def _bind(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation):
    from .primitive import attn_dist_p  # primitive.py imports this module lazily

    return attn_dist_p.bind(
        q, k, indices, lse, q_start, sm_scale=sm_scale, causal=causal, k_stride=k_stride,
        lse_base=lse_base, implementation=implementation,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attn_dist_vjp(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation):
    return _bind(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation)


def _vjp_fwd(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation):
    out = _bind(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation)
    return out, (q, k, indices, lse, q_start)


def _vjp_bwd(sm_scale, causal, k_stride, lse_base, implementation, residuals, g):
    q, k, indices, lse, q_start = residuals
    bwd = functools.partial(
        attn_dist_bwd_canonical, sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base,
    )
    dq, dk, dlse = run_with_auto_axes(
        bwd, (q, k, indices, lse, q_start, g),
        lambda: tuple(jax.sharding.PartitionSpec(*dim_specs(x)) for x in (q, k, lse)),
    )
    return dq, dk, None, dlse, None  # indices, q_start: integer, no gradient


_attn_dist_vjp.defvjp(_vjp_fwd, _vjp_bwd)


def attn_dist_canonical(
    q, k, indices, lse, q_start, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, implementation: Optional[str],
):
    """``attn_dist_p.bind`` on canonical operands, differentiable w.r.t. q, k
    and lse (static parameters already checked)."""
    return _attn_dist_vjp(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation)
