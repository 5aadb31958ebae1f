"""The jnp references: the executable forms of SPEC §2 (``attn_dist``) and
SPEC §5 (``indexer_kl``), on any backend.

They are also the XLA paths of the public functions, so they are written to
run well under XLA on a GPU and to keep temporaries bounded (chunked over
query rows; see ``_chunks.py``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from . import _contract
from ._chunks import (
    HIGHEST,
    LOG2E,
    chunk_rows,
    chunk_scores,
    group_sum,
    probabilities,
    row_chunked,
    row_loop,
    rows_of,
)


# ----------------------------------------------------------------------------
# attn_dist (SPEC §2)
# ----------------------------------------------------------------------------


def reference_canonical(
    q, k, indices, lse, q_start, row_ranges, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, chunk: Optional[int] = None, **unused_params,
):
    """SPEC §2 on canonical operands: q [B,S,H,D], k [B,N,HK,D],
    indices [B,S,HK,T] int32, lse [B,S,H] float32, q_start [B] int32,
    row_ranges [B,S,3] int32 or [B,S,0] (SPEC §6's ranges, or none; see
    ``_contract.ROW_RANGE_FIELDS``). Returns float32 [B, G, S, T]. Parameters must already be checked.

    ``chunk`` overrides the rows per chunk (tests use it to exercise the
    chunk loop on small problems). Extra keyword parameters (e.g. the
    primitive's ``implementation``) are ignored.
    """
    problem = _contract.check_canonical(q, k, indices, lse, q_start, row_ranges)
    B, S, H, HK, T, G = problem.B, problem.S, problem.H, problem.HK, problem.T, problem.G
    if problem.is_empty:
        return jnp.zeros(problem.canonical_out_shape, jnp.float32)
    R = B * S
    C = min(int(chunk), R) if chunk else chunk_rows(problem)
    Hg = H // HK

    def body(start):
        scores = chunk_scores(q, k, indices, q_start, row_ranges, start, C, problem, causal=causal,
                              k_stride=k_stride)
        lse_rows = rows_of(lse, start, C).reshape(C, HK, Hg)
        p, _ = probabilities(scores.acc, scores.valid, lse_rows, sm_scale=sm_scale, lse_base=lse_base)
        return group_sum(p.reshape(C, H, T), H)

    out = row_chunked(body, R, C, (G, T), jnp.float32)  # [R, G, T]
    return out.reshape(B, S, G, T).transpose(0, 2, 1, 3)


def exact_lse_canonical(
    q, k, indices, q_start, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, empty_value: float = float("inf"),
):
    """The float32 log-sum-exp, in base ``lse_base``, of ``z = sm_scale * q.k``
    over the valid slots of each (row, head) -- the ``lse`` a forward kernel
    would produce for this selection. Rows with no valid slot get
    ``empty_value`` (+inf, as FlashMLA writes). Canonical operands; returns
    [B, S, H] float32. Used by the synthetic problem generator and the
    training example (as a stand-in for the sparse MLA forward)."""
    B, S, H = (int(d) for d in q.shape[:3])
    lse_dummy = jax.ShapeDtypeStruct((B, S, H), jnp.float32)
    row_ranges = _contract.no_row_ranges(B, S)
    problem = _contract.check_canonical(q, k, indices, lse_dummy, q_start, row_ranges)
    if problem.is_empty:
        return jnp.full((B, S, H), empty_value, jnp.float32)
    R = B * S
    C = chunk_rows(problem)

    def body(start):
        scores = chunk_scores(q, k, indices, q_start, row_ranges, start, C, problem, causal=causal,
                              k_stride=k_stride)
        acc, valid = scores.acc, scores.valid
        z = acc * jnp.float32(sm_scale)
        z = jnp.where(valid[:, :, None, :], z, -jnp.inf)
        m = jnp.max(z, axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        lse_e = jnp.log(jnp.sum(jnp.exp(z - m_safe), axis=-1)) + m_safe[..., 0]
        any_valid = jnp.any(valid, axis=-1)[:, :, None]
        lse_b = lse_e if lse_base == "e" else lse_e * jnp.float32(LOG2E)
        return jnp.where(any_valid, lse_b, jnp.float32(empty_value)).reshape(C, -1)

    return row_chunked(body, R, C, (H,), jnp.float32).reshape(B, S, H)


def canonicalize(problem, *arrays_and_q_start):
    """Adds the batch dimension to every array when absent and makes the
    last argument, ``q_start_index`` (int or int array [] / [B]), int32 [B]."""
    *arrays, q_start_index = arrays_and_q_start
    if not problem.batched:
        arrays = [x[None] for x in arrays]
    arrays = [jnp.asarray(x) for x in arrays]
    if isinstance(q_start_index, int):
        q_start = jnp.full((problem.B,), q_start_index, jnp.int32)
    else:
        q_start = jnp.broadcast_to(jnp.asarray(q_start_index).astype(jnp.int32), (problem.B,))
    return (*arrays, q_start)


def attn_dist_reference(
    q, k, indices, lse, *, sm_scale, causal=True, q_start_index=0, k_stride=1, lse_base="2",
):
    """The jnp reference of :func:`jax_attn_dist.attn_dist` (same arguments
    except ``implementation``; same result up to float32 rounding). Runs on any
    backend, under ``jit`` or eagerly; the semantics are SPEC §2."""
    problem = _contract.check_problem(q, k, indices, lse)
    params = _contract.check_params(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base)
    q_start_index = _contract.check_q_start_index(q_start_index, problem)
    args = canonicalize(problem, q, k, indices, lse, q_start_index)
    out = reference_canonical(*args, _contract.no_row_ranges(problem.B, problem.S), **params.as_dict())
    return out if problem.batched else out[0]


# ----------------------------------------------------------------------------
# indexer_kl (SPEC §5)
# ----------------------------------------------------------------------------


def indexer_chunk_rows(problem: _contract.IndexerProblem, backward: bool = False) -> int:
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
    ``scores`` is the :class:`_chunks.ChunkScores` (gathered keys, rows).
    Canonical operands (index_k [B, N, DI])."""
    scores = chunk_scores(index_q, index_k[:, :, None, :], indices, q_start, row_ranges, start, C,
                          problem.scores, causal=causal, k_stride=k_stride)
    z = scores.acc[:, 0]  # [C, HI, T]
    w = rows_of(weights, start, C).astype(jnp.float32)  # [C, HI]
    logits = jnp.float32(scale) * jnp.einsum("rh,rht->rt", w, jnp.maximum(z, 0.0), precision=HIGHEST)
    return logits, scores.valid[:, 0], z, w, scores


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
    problem = _contract.check_indexer_canonical(index_q, index_k, weights, indices, target, q_start, row_ranges)
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
    problem = _contract.check_indexer_problem(index_q, index_k, weights, indices, target, who)
    params = _contract.check_indexer_params(scale=scale, causal=causal, k_stride=k_stride, deterministic=False,
                                            who=who)
    q_start_index = _contract.check_q_start_index(q_start_index, problem, who)
    args = canonicalize(problem, index_q, index_k, weights, indices, target, q_start_index)
    kl, _ = indexer_reference_canonical(*args, _contract.no_row_ranges(problem.B, problem.S), scale=params.scale,
                                        causal=params.causal, k_stride=params.k_stride)
    return kl if problem.batched else kl[0]
