"""The indexer's jnp backward pass: the executable form of SPEC §5.3's
gradient formulas.

It recomputes the logits from the inputs and the forward's per-row
log-sum-exp (no ``[B, S, HI, T]`` residual), chunked over the B*S query rows
like the reference, and computes the gradients in float32
(``Precision.HIGHEST``: no TF32 on GPUs). Row gradients are written per
chunk; ``d index_k`` accumulates in float32 over the chunks, in chunk order
(with ``deterministic``, by a sort and a segmented scan). Results come back
in the input dtypes.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from ..._core.chunks import HIGHEST, row_loop, rows_of, sorted_segment_scatter_add
from . import contract
from .reference import indexer_chunk_rows, indexer_logits, teacher


def indexer_bwd_canonical(
    index_q, index_k, weights, indices, target, q_start, row_ranges, lse, g, *, scale: float, causal: bool,
    k_stride: int, deterministic: bool, chunk: Optional[int] = None, **unused_params,
):
    """Gradients ``(d_index_q, d_index_k, d_weights)`` of ``sum(g * kl)`` for
    SPEC §5 on canonical operands (as ``indexer_reference_canonical``), with
    ``lse`` [B,S] the forward's per-row log-sum-exp residual and ``g`` [B,S]
    the cotangent of ``kl``::

        dl(s, j)   = g(s) * (softmax(s, j) * tau(s) - t(s, j))   on valid slots
        d w[s, h]  = scale * sum_j dl * relu(z)
        dz         = dl * scale * w[s, h] * [z > 0]
        d iq[s, h] = sum_j dz * index_k[i];   d ik[i] += sum_h dz * index_q[s, h]

    Rows with no valid slot or an all-zero t contribute exactly 0.
    ``deterministic``: ``d index_k`` is accumulated by a sort and a
    segmented scan in a fixed order (bitwise reproducible on a GPU too)
    instead of an XLA scatter-add (atomics on a GPU)."""
    problem = contract.check_canonical(index_q, index_k, weights, indices, target, q_start, row_ranges)
    B, S, HI, DI, N, T = problem.B, problem.S, problem.HI, problem.DI, problem.N, problem.T
    if problem.is_empty:
        return jnp.zeros_like(index_q), jnp.zeros_like(index_k), jnp.zeros_like(weights)
    R = B * S
    C = min(int(chunk), R) if chunk else indexer_chunk_rows(problem, backward=True)
    g = g.astype(jnp.float32)

    def chunk_grads(start, first_new, dk):
        logits, valid, z, w, scores = indexer_logits(index_q, index_k, weights, indices, q_start, row_ranges,
                                                     start, C, problem, scale=scale, causal=causal,
                                                     k_stride=k_stride)
        t = teacher(rows_of(target, start, C), valid)
        tau = jnp.sum(t, axis=-1)
        live = valid & (tau > 0)[:, None]
        lse_rows = rows_of(lse, start, C)
        p = jnp.where(live, jnp.exp(logits - jnp.where(live, lse_rows[:, None], 0.0)), 0.0)
        dl = jnp.where(live, rows_of(g, start, C)[:, None] * (p * tau[:, None] - t), 0.0)  # [C, T]

        dw_rows = jnp.float32(scale) * jnp.einsum("rt,rht->rh", dl, jnp.maximum(z, 0.0), precision=HIGHEST)
        dz = jnp.where(z > 0, dl[:, None, :] * (jnp.float32(scale) * w)[:, :, None], 0.0)  # [C, HI, T]
        kg = scores.kg[:, 0].astype(jnp.float32)  # [C, T, DI]
        dq_rows = jnp.einsum("rht,rtd->rhd", dz, kg, precision=HIGHEST)

        fresh = scores.rows >= first_new
        dz_new = jnp.where(fresh[:, None, None], dz, 0.0)
        dk_rows = jnp.einsum("rht,rhd->rtd", dz_new, scores.q_rows[:, 0].astype(jnp.float32), precision=HIGHEST)
        key = jnp.where(valid & fresh[:, None], scores.b_rows[:, None] * N + scores.idx_c[:, 0], B * N)
        key, dk_rows = key.reshape(C * T), dk_rows.reshape(C * T, DI)
        if deterministic:
            dk = sorted_segment_scatter_add(dk, key, dk_rows, num_keys=B * N)
        else:
            dk = dk.at[key].add(dk_rows, mode="drop")
        return (dq_rows, dw_rows), dk

    dk0 = jnp.zeros((B * N, DI), jnp.float32)
    (dq, dw), dk = row_loop(chunk_grads, R, C, [((HI, DI), jnp.float32), ((HI,), jnp.float32)], dk0)
    return (dq.reshape(B, S, HI, DI).astype(index_q.dtype), dk.reshape(B, N, DI).astype(index_k.dtype),
            dw.reshape(B, S, HI).astype(weights.dtype))
