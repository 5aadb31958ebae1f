"""attn_dist's jnp reference: the executable form of SPEC §2, on any backend.

It is also attn_dist's XLA path, so it is written to run well under XLA on a
GPU and to keep its temporaries bounded (chunked over query rows; see
``_core/chunks.py``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..._core import checks
from ..._core.chunks import LOG2E, chunk_rows, chunk_scores, probabilities, row_chunked, rows_of
from ..._core.checks import canonicalize
from . import contract
from .contract import HEADS_PER_GROUP


# ----------------------------------------------------------------------------
# attn_dist (SPEC §2)
# ----------------------------------------------------------------------------


def group_sum(p, H: int):
    """[C, H, T] -> [C, G, T]: out[:, g] sums heads 64g .. min(64g+64, H)-1."""
    C, _, T = p.shape
    full, rem = divmod(H, HEADS_PER_GROUP)
    parts = []
    if full:
        parts.append(p[:, : full * HEADS_PER_GROUP].reshape(C, full, HEADS_PER_GROUP, T).sum(axis=2))
    if rem:
        parts.append(p[:, full * HEADS_PER_GROUP :].sum(axis=1, keepdims=True))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)



def reference_canonical(
    q, k, indices, lse, q_start, row_ranges, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, chunk: Optional[int] = None, **unused_params,
):
    """SPEC §2 on canonical operands: q [B,S,H,D], k [B,N,HK,D],
    indices [B,S,HK,T] int32, lse [B,S,H] float32, q_start [B] int32,
    row_ranges [B,S,3] int32 or [B,S,0] (SPEC §6's ranges, or none; see
    ``checks.ROW_RANGE_FIELDS``). Returns float32 [B, G, S, T]. Parameters must already be checked.

    ``chunk`` overrides the rows per chunk (tests use it to exercise the
    chunk loop on small problems). Extra keyword parameters (e.g. the
    primitive's ``implementation``) are ignored.
    """
    problem = contract.check_canonical(q, k, indices, lse, q_start, row_ranges)
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
    row_ranges = checks.no_row_ranges(B, S)
    problem = contract.check_canonical(q, k, indices, lse_dummy, q_start, row_ranges)
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


def attn_dist_reference(
    q, k, indices, lse, *, sm_scale, lse_base=None, causal=True, q_start_index=0, k_stride=1,
):
    """The jnp reference of :func:`jax_attn_dist.attn_dist` (same arguments
    except ``implementation``; same result up to float32 rounding). Runs on any
    backend, under ``jit`` or eagerly; the semantics are SPEC §2."""
    who = "attn_dist_reference"
    problem = contract.check_problem(q, k, indices, lse, who)
    params = contract.check_params(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base, who=who)
    q_start_index = checks.check_q_start_index(q_start_index, problem, who)
    args = canonicalize(problem, q, k, indices, lse, q_start_index)
    out = reference_canonical(*args, checks.no_row_ranges(problem.B, problem.S), **params.as_dict())
    return out if problem.batched else out[0]


