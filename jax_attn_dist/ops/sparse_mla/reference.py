"""sparse_mla's jnp reference: the executable form of SPEC §8, on any backend.

It is also sparse_mla's XLA path, so it keeps its temporaries bounded: it
runs over chunks of query rows (``_core/chunks.py``), and per chunk gathers
the selected kv rows once, forms the scores exactly as attn_dist does (input
dtype products, float32 accumulation), and computes the softmax and the
``P . V`` product in float32 (``Precision.HIGHEST``: no TF32 on a GPU).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from ..._core import checks
from ..._core.chunks import CHUNK_BYTES, HIGHEST, LOG2E, chunk_rows, chunk_scores, row_loop
from ..._core.checks import canonicalize
from . import contract


def sparse_mla_chunk_rows(problem: contract.Problem, d_v: int, backward: bool = False) -> int:
    """Query rows per chunk (>= 1): ``chunk_rows`` with sparse_mla's per-row
    temporaries: the gathered kv rows in their dtype and their value part in
    float32, about four float32 [H, T] arrays and the float32 [H, d_v]
    output; the backward adds the float32 kv gradient terms [HK, T, D], two
    more [H, T] arrays and the float32 [H, D] / [H, d_v] row gradients."""
    itemsize = jnp.dtype(problem.dtype).itemsize
    per_row = (problem.HK * problem.T * (problem.D * itemsize + d_v * 4)
               + 4 * problem.H * problem.T * 4 + problem.H * d_v * 4)
    if backward:
        per_row += problem.HK * problem.T * problem.D * 8 + 2 * problem.H * problem.T * 4
        per_row += problem.H * (problem.D + d_v) * 4
    return chunk_rows(problem, per_row_bytes=per_row, budget=CHUNK_BYTES)


def lse_natural(lse_rows, lse_base: str):
    """The natural-log lse from one in base ``lse_base``."""
    return lse_rows if lse_base == "e" else lse_rows * jnp.float32(1.0 / LOG2E)


def chunk_forward(scores, *, sm_scale: float, d_v: int):
    """``(out [C, HK, Hg, d_v] f32, lse_e [C, HK, Hg] f32)`` of one chunk
    (SPEC §8): the softmax over each head's valid slots, written around the
    row maximum; a head with no valid slot gets out 0 and lse_e -inf."""
    valid = scores.valid[:, :, None, :]                              # [C, HK, 1, T]
    z = jnp.where(valid, scores.acc * jnp.float32(sm_scale), -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, jnp.float32(0.0))
    e = jnp.where(valid, jnp.exp(z - m_safe), jnp.float32(0.0))
    l = jnp.sum(e, axis=-1)                                         # [C, HK, Hg]
    has = l > 0
    p = e / jnp.where(has, l, jnp.float32(1.0))[..., None]
    v = scores.kg[..., :d_v].astype(jnp.float32)                    # [C, HK, T, d_v]
    out = jnp.einsum("rkht,rktd->rkhd", p, v, precision=HIGHEST)
    lse_e = jnp.where(has, m_safe[..., 0] + jnp.log(jnp.where(has, l, jnp.float32(1.0))), -jnp.inf)
    return out, lse_e


def reference_canonical(
    q, kv, indices, q_start, row_ranges, *, sm_scale: float, causal: bool, k_stride: int, lse_base: str,
    d_v: int, chunk: Optional[int] = None, **unused_params,
):
    """SPEC §8 on canonical operands: q [B,S,H,D], kv [B,N,HK,D],
    indices [B,S,HK,T] int32, q_start [B] int32, row_ranges [B,S,3] int32 or
    [B,S,0] (SPEC §6's ranges, or none). Returns ``(out, lse)``: out
    [B,S,H,d_v] in q's dtype, lse [B,S,H] float32 in base ``lse_base``.
    Parameters must already be checked; ``chunk`` overrides the rows per
    chunk (tests use it to exercise the chunk loop on small problems)."""
    problem = contract.check_canonical(q, kv, indices, q_start, row_ranges)
    B, S, H = problem.B, problem.S, problem.H
    if problem.is_empty:
        return (jnp.zeros(problem.canonical_out_shape(d_v), q.dtype),
                jnp.full(problem.canonical_lse_shape, -jnp.inf, jnp.float32))
    R = B * S
    C = min(int(chunk), R) if chunk else sparse_mla_chunk_rows(problem, d_v)

    def body(start, _, carry):
        scores = chunk_scores(q, kv, indices, q_start, row_ranges, start, C, problem, causal=causal,
                              k_stride=k_stride)
        out, lse_e = chunk_forward(scores, sm_scale=sm_scale, d_v=d_v)
        lse = lse_e if lse_base == "e" else lse_e * jnp.float32(LOG2E)
        return (out.reshape(C, H, d_v).astype(q.dtype), lse.reshape(C, H)), carry

    (out, lse), _ = row_loop(body, R, C, [((H, d_v), q.dtype), ((H,), jnp.float32)], None)
    return out.reshape(B, S, H, d_v), lse.reshape(B, S, H)


def sparse_mla_reference(
    q, kv, indices, *, sm_scale, d_v=contract.KERNEL_D_V, causal=True, q_start_index=0, k_stride=1, lse_base="2",
):
    """The jnp reference of :func:`jax_attn_dist.sparse_mla` (its arguments
    except SPEC §6's keywords, ``deterministic`` and ``implementation``;
    the same result up to float32 rounding): ``(out, lse)``. Runs on any
    backend, under ``jit`` or eagerly; the semantics are SPEC §8. Not
    differentiable through a custom rule (use ``sparse_mla`` for gradients)."""
    who = "sparse_mla_reference"
    problem = contract.check_problem(q, kv, indices, who)
    params = contract.check_params(problem, sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base,
                                   d_v=d_v, deterministic=False, who=who)
    q_start_index = checks.check_q_start_index(q_start_index, problem, who)
    q, kv, indices, q_start = canonicalize(problem, q, kv, indices, q_start_index)
    out, lse = reference_canonical(q, kv, indices, q_start, checks.no_row_ranges(problem.B, problem.S),
                                   **params.as_dict())
    return (out, lse) if problem.batched else (out[0], lse[0])
