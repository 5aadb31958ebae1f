"""attn_dist's jnp backward pass: the executable form of SPEC §2.6's
gradient formulas.

It recomputes what it needs from the inputs (no ``[B, S, H, T]`` residual),
chunked over the B*S query rows like the reference (temporaries bounded
independently of S): per chunk it gathers the top-k key rows once,
recompute the scores exactly as the forward does (bf16 products, float32
accumulation) and compute the gradients in float32 (``Precision.HIGHEST``:
no TF32 on GPUs). Row gradients are written per chunk; key gradients
accumulate in float32 over the chunks, in chunk order. Results come back in
the input dtypes.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from ..._core.chunks import CHUNK_BYTES, HIGHEST, LN2, chunk_rows, chunk_scores, probabilities, row_loop, rows_of
from . import contract
from .contract import HEADS_PER_GROUP, Problem


def backward_chunk_rows(problem: Problem) -> int:
    """Query rows per attn_dist backward chunk (>= 1): ``chunk_rows`` with
    this module's byte budget (tests lower it) and the backward's larger
    per-row temporaries (gathered keys in their dtype and in float32, their
    float32 dk contribution, and about six float32 [H, T] arrays)."""
    itemsize = jnp.dtype(problem.dtype).itemsize
    per_row = (
        problem.HK * problem.T * problem.D * (itemsize + 8)
        + 6 * problem.H * problem.T * 4
        + 2 * problem.H * problem.D * 4
    )
    return chunk_rows(problem, per_row_bytes=per_row, budget=CHUNK_BYTES)


def attn_dist_bwd_canonical(
    q, k, indices, lse, q_start, row_ranges, g, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, chunk: Optional[int] = None, **unused_params,
):
    """Gradients ``(dq, dk, dlse)`` of ``sum(g * attn_dist(...))`` on canonical
    operands (q [B,S,H,D], k [B,N,HK,D], indices [B,S,HK,T] int32,
    lse [B,S,H] f32, q_start [B] int32, row_ranges [B,S,3|0] int32;
    g [B,G,S,T]). ``dq``/``dk`` have the
    dtype of q/k, ``dlse`` is float32. ``chunk`` overrides the rows per chunk.

    With ``G`` the cotangent of ``out[g(h), s, j]``, ``p`` SPEC §2's
    probabilities and ``c`` = 1 (lse base e) or ln 2 (base 2)::

        dz = G * p * sm_scale;  dq[s, h] = sum_j dz * k[i];
        dk[i] += sum_h dz * q[s, h];  dlse[s, h] = -c * sum_j G * p

    Where ``p`` is 0 every term is exactly 0, whatever ``G`` or ``lse`` hold."""
    problem = contract.check_canonical(q, k, indices, lse, q_start, row_ranges)
    B, S, H, D, N, HK, T, G = (
        problem.B, problem.S, problem.H, problem.D, problem.N, problem.HK, problem.T, problem.G,
    )
    if problem.is_empty:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(lse)
    R = B * S
    Hg = H // HK
    C = min(int(chunk), R) if chunk else backward_chunk_rows(problem)

    g_flat = g.astype(jnp.float32).transpose(0, 2, 1, 3)  # [B, S, G, T]
    kh = jnp.arange(HK, dtype=jnp.int32)
    c = 1.0 if lse_base == "e" else LN2

    def chunk_grads(start, first_new, dk):
        """dq rows (q dtype) and dlse rows, and ``dk`` plus this chunk's
        scatter-add (rows before ``first_new`` were done by the previous
        chunk: the last chunk may overlap it and adds nothing for them)."""
        lse_rows = rows_of(lse, start, C).reshape(C, HK, Hg)
        g_rows = rows_of(g_flat, start, C)  # [C, G, T]
        # the forward's scores, recomputed by the reference's own code
        scores = chunk_scores(q, k, indices, q_start, row_ranges, start, C, problem, causal=causal,
                              k_stride=k_stride)
        valid, idx_c, kg, q_rows, rows = scores.valid, scores.idx_c, scores.kg, scores.q_rows, scores.rows
        p, keep = probabilities(scores.acc, valid, lse_rows, sm_scale=sm_scale, lse_base=lse_base)

        # G per head: group g(h) = h // 64 of head h = kh * Hg + hh
        g_heads = jnp.repeat(g_rows, HEADS_PER_GROUP, axis=1, total_repeat_length=G * HEADS_PER_GROUP)
        g_heads = g_heads[:, :H].reshape(C, HK, Hg, T)
        gp = jnp.where(keep, g_heads * p, jnp.float32(0.0))  # [C, HK, Hg, T]

        dlse_rows = (gp.sum(axis=-1) * jnp.float32(-c)).reshape(C, H)
        dz = gp * jnp.float32(sm_scale)
        dq_rows = jnp.einsum("rkht,rktd->rkhd", dz, kg.astype(jnp.float32), precision=HIGHEST).reshape(C, H, D)

        fresh = rows >= first_new
        dz_new = jnp.where(fresh[:, None, None, None], dz, jnp.float32(0.0))
        dk_rows = jnp.einsum("rkht,rkhd->rktd", dz_new, q_rows.astype(jnp.float32), precision=HIGHEST)
        target = jnp.where(valid, idx_c, N)  # invalid slots: out of bounds, dropped
        dk = dk.at[scores.b_rows[:, None, None], target, kh[None, :, None]].add(dk_rows, mode="drop")
        return (dq_rows.astype(q.dtype), dlse_rows), dk

    dk0 = jnp.zeros((B, N, HK, D), jnp.float32)
    (dq, dlse), dk = row_loop(chunk_grads, R, C, [((H, D), q.dtype), ((H,), jnp.float32)], dk0)
    return dq.reshape(B, S, H, D), dk.astype(k.dtype), dlse.reshape(B, S, H)
