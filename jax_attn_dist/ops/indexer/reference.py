"""The indexer's jnp reference: the executable form of SPEC §5.2, on any
backend. It is also ``indexer_kl``'s XLA path (chunked over query rows like
attn_dist's; see ``_core/chunks.py``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..._core import checks
from ..._core.chunks import HIGHEST, chunk_rows, chunk_scores, row_loop, rows_of
from ..._core.checks import canonicalize
from . import contract


def indexer_chunk_rows(problem: contract.Problem, backward: bool = False) -> int:
    """Rows per chunk of the indexer's jnp paths: gathered index_k rows plus
    float32 [HI, T] temporaries (about three in the forward, six in the
    backward, with the float32 d index_k terms [T, DI])."""
    itemsize = jnp.dtype(problem.dtype).itemsize
    per_row = problem.T * problem.DI * itemsize + 3 * problem.HI * problem.T * 4
    if backward:
        per_row += problem.T * problem.DI * 8 + 3 * problem.HI * problem.T * 4 + 2 * problem.HI * problem.DI * 4
    return chunk_rows(problem.scores, per_row_bytes=per_row)


def indexer_logits(index_q, index_k, weights, indices, q_start, row_ranges, start, C: int, problem, *,
                   scale: float, causal: bool, k_stride: int):
    """SPEC §5's logits of rows ``start .. start+C-1``: ``(logits [C, T] f32,
    valid [C, T] bool, z [C, HI, T] f32, w [C, HI] f32, scores)`` where
    ``scores`` is the :class:`_core.chunks.ChunkScores` (gathered keys, rows).
    Canonical operands (index_k [B, N, DI])."""
    scores = chunk_scores(index_q, index_k[:, :, None, :], indices, q_start, row_ranges, start, C,
                          problem.scores, causal=causal, k_stride=k_stride)
    z = scores.acc[:, 0]  # [C, HI, T]
    w = rows_of(weights, start, C).astype(jnp.float32)  # [C, HI]
    logits = jnp.float32(scale) * jnp.einsum("rh,rht->rt", w, jnp.maximum(z, 0.0), precision=HIGHEST)
    return logits, scores.valid[:, 0], z, w, scores


def sum_in_fixed_order(x, axis: int):
    """``x.sum(axis)`` of a float32 or float64 array as a fixed tree of
    elementwise adds: the axis, zero-padded to a power of two, halved by
    adding its upper half to its lower half until one element is left. XLA
    sums a reduce in an order of its choosing, made per program (it differs
    between a one-GPU program and the same program with its rows sharded,
    and may differ between compilations); elementwise adds it keeps as
    written, so these bits depend on neither."""
    if x.dtype not in (jnp.float32, jnp.float64):
        raise TypeError(f"sum_in_fixed_order sums float32 or float64, got {x.dtype}")
    axis = axis % x.ndim
    n = x.shape[axis]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - n)
        x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        x = (jax.lax.slice_in_dim(x, 0, half, axis=axis) +
             jax.lax.slice_in_dim(x, half, 2 * half, axis=axis))
    return jax.lax.squeeze(x, (axis,))


def target_from_dist(dist):
    """SPEC §5.4's target from attn_dist's canonical ``[B, G, S, T]``: the
    groups summed, each row L1-normalised over its slots (0 where its mass is
    0), under ``stop_gradient`` (the main attention is not trained by it)."""
    mass = sum_in_fixed_order(dist, axis=1)                                                # [B, S, T]
    total = sum_in_fixed_order(mass, axis=-1)[..., None]
    return jax.lax.stop_gradient(jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), 0.0))


def teacher(target_rows, valid):
    """t(s, j) of SPEC §5: the target where the slot is valid and the target
    positive (a NaN target is not positive), else 0."""
    return jnp.where(valid & (target_rows > 0), target_rows, jnp.float32(0.0))


def kl_rows(logits, valid, t):
    """``(kl [C], lse [C])`` of SPEC §5 from one chunk's logits: ``lse`` is
    the log-sum-exp of the valid logits (-inf for a row with none), and
    ``kl = sum_j t (log t - logit + lse)``, exactly 0 for a row whose t is
    all 0. Written around the row maximum so that no term is large."""
    x = jnp.where(valid, logits, -jnp.inf)
    m = jnp.max(x, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    l = jnp.sum(jnp.exp(x - m_safe[:, None]), axis=-1)
    positive = t > 0
    t_log_t = jnp.sum(jnp.where(positive, t * jnp.log(jnp.where(positive, t, 1.0)), 0.0), axis=-1)
    t_shifted = jnp.sum(jnp.where(positive, t * (logits - m_safe[:, None]), 0.0), axis=-1)
    tau = jnp.sum(t, axis=-1)
    log_l = jnp.log(jnp.where(l > 0, l, 1.0))
    kl = jnp.where(tau > 0, t_log_t - t_shifted + tau * log_l, 0.0)
    lse = jnp.where(l > 0, m_safe + log_l, -jnp.inf)
    return kl, lse


def indexer_reference_canonical(
    index_q, index_k, weights, indices, target, q_start, row_ranges, *, scale: float, causal: bool,
    k_stride: int, chunk: Optional[int] = None, **unused_params,
):
    """SPEC §5 on canonical operands: index_q [B,S,HI,DI], index_k [B,N,DI],
    weights [B,S,HI], indices [B,S,1,T] int32, target [B,S,T] f32,
    q_start [B] int32, row_ranges [B,S,3|0] int32. Returns ``(kl, lse)``, both float32 [B, S]: the
    per-row KL and the row's log-sum-exp over its valid logits (the residual
    the backward uses; -inf for a row with no valid slot)."""
    problem = contract.check_canonical(index_q, index_k, weights, indices, target, q_start, row_ranges)
    B, S = problem.B, problem.S
    if problem.is_empty:
        return jnp.zeros((B, S), jnp.float32), jnp.full((B, S), -jnp.inf, jnp.float32)
    R = B * S
    C = min(int(chunk), R) if chunk else indexer_chunk_rows(problem)

    def body(start, _, carry):
        logits, valid, *_ = indexer_logits(index_q, index_k, weights, indices, q_start, row_ranges, start, C,
                                           problem, scale=scale, causal=causal, k_stride=k_stride)
        t = teacher(rows_of(target, start, C), valid)
        return kl_rows(logits, valid, t), carry

    (kl, lse), _ = row_loop(body, R, C, [((), jnp.float32), ((), jnp.float32)], None)
    return kl.reshape(B, S), lse.reshape(B, S)


def indexer_kl_reference(
    index_q, index_k, weights, indices, target, *, scale=1.0, causal=True, q_start_index=0, k_stride=1,
):
    """The jnp reference of :func:`jax_attn_dist.indexer_kl` (same arguments
    except ``deterministic`` and ``implementation``): float32 ``[B?, S]``.
    Runs on any backend; the semantics are SPEC §5. Not differentiable
    through a custom rule (use ``indexer_kl`` for gradients)."""
    who = "indexer_kl_reference"
    problem = contract.check_problem(index_q, index_k, weights, indices, target, who)
    params = contract.check_params(scale=scale, causal=causal, k_stride=k_stride, deterministic=False,
                                            who=who)
    q_start_index = checks.check_q_start_index(q_start_index, problem, who)
    args = canonicalize(problem, index_q, index_k, weights, indices, target, q_start_index)
    kl, _ = indexer_reference_canonical(*args, checks.no_row_ranges(problem.B, problem.S), scale=params.scale,
                                        causal=params.causal, k_stride=params.k_stride)
    return kl if problem.batched else kl[0]
