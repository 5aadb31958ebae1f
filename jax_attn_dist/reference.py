"""The jnp reference: the executable form of SPEC §2, on any backend.

It is also the XLA fallback path of ``attn_dist``, so it is written to run well
under XLA on a GPU: one gather of the top-k key rows and one batched matmul
(bf16 products, float32 accumulation) per chunk of query rows; no Python loops
over heads or slots; no float64.

Temporaries are bounded independently of B and S: the B*S query rows are
processed in chunks of ``C`` rows inside a ``fori_loop`` (C picked so that one
chunk's gathered keys and scores take about ``_CHUNK_BYTES``). The loop slices
its inputs in place (no padded copy of ``q``): the last chunk starts at
``R - C`` and may overlap the previous one, recomputing identical rows.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from . import _contract
from ._contract import HEADS_PER_GROUP, Problem

#: Bytes of per-chunk temporaries the reference aims for (gathered keys plus
#: float32 scores). For S=4096, N=8192, H=128, T=2048, D=576 bf16 this gives
#: chunks of 96 query rows and about 0.4 GiB of temporaries (XLA's count on an
#: H100 with jax 0.11.2); larger chunks gain a few percent of speed there
#: (14.2 ms at 128 rows, 13.4 ms at 256 rows with 0.9 GiB).
_CHUNK_BYTES = 512 << 20
_MAX_CHUNK_ROWS = 1024

LOG2E = math.log2(math.e)


def chunk_rows(problem: Problem, per_row_bytes: Optional[int] = None, budget: Optional[int] = None) -> int:
    """Query rows per chunk for this problem (>= 1): ``budget`` bytes
    (default ``_CHUNK_BYTES``) of temporaries at ``per_row_bytes`` per query
    row (default: the forward's gathered keys plus three float32 [H, T]
    arrays)."""
    if per_row_bytes is None:
        itemsize = jnp.dtype(problem.dtype).itemsize
        per_row_bytes = problem.HK * problem.T * problem.D * itemsize + 3 * problem.H * problem.T * 4
    if budget is None:
        budget = _CHUNK_BYTES
    rows = max(1, budget // max(per_row_bytes, 1))
    rows = min(rows, _MAX_CHUNK_ROWS, max(problem.B * problem.S, 1))
    if rows >= 16:
        rows -= rows % 8
    return int(rows)


def _row_loop(body: Callable, R: int, C: int, out_specs, carry):
    """Runs ``body`` over chunks of ``C`` of the ``R`` rows; returns
    ``(outs, carry)``. ``body(start, first_new, carry)`` computes rows
    ``start .. start + C - 1`` and returns ``(blocks, carry)``: one block
    ``[C, *tail]`` per ``(tail, dtype)`` of ``out_specs``, written into the
    output ``[R, *tail]`` at ``start``, and the updated ``carry`` (e.g. an
    accumulator). Chunks start at multiples of C except the last, at
    ``R - C``: it may overlap the previous one, whose rows (those before
    ``first_new``) it recomputes. ``start`` and ``first_new`` are traced int32
    except when there is one chunk; then ``body``'s blocks are returned as
    they are."""
    if C >= R:
        zero = jnp.int32(0)
        return body(zero, zero, carry)
    n_chunks = -(-R // C)

    def step(i, state):
        outs, carry = state
        start = jnp.minimum(i * C, R - C).astype(jnp.int32)
        blocks, carry = body(start, i * C, carry)
        outs = tuple(
            jax.lax.dynamic_update_slice_in_dim(out, block.astype(out.dtype), start, axis=0)
            for out, block in zip(outs, blocks)
        )
        return outs, carry

    outs = tuple(jnp.zeros((R,) + tuple(tail), dtype) for tail, dtype in out_specs)
    return jax.lax.fori_loop(0, n_chunks, step, (outs, carry))


def _row_chunked(body: Callable, R: int, C: int, tail_shape, dtype):
    """Returns ``concat([body(start) for start in chunk starts])`` as an array
    ``[R, *tail_shape]``, where ``body(start)`` computes rows
    ``start .. start + C - 1`` (see :func:`_row_loop`)."""
    (out,), _ = _row_loop(lambda start, _, carry: ((body(start),), carry), R, C, [(tail_shape, dtype)], None)
    return out


def _causal_parts(q_start, k_stride: int):
    """Splits the int32 per-batch ``q_start`` into ``qq = floor(q_start / ks)`` and
    ``qr = q_start - qq * ks`` (0 <= qr < ks), exactly, without overflow."""
    ks = jnp.int32(k_stride)
    qq = jnp.floor_divide(q_start, ks)
    qr = q_start - qq * ks  # in [0, ks): no overflow
    return qq, qr


def _valid_slots(idx, b_rows, s_rows, qq, qr, *, N: int, causal: bool, k_stride: int):
    """``valid[r, kh, j]`` per SPEC §2, and the indices clamped into [0, N-1].

    The causal rule ``i <= floor((q0 + s + 1 - ks) / ks)`` is evaluated exactly
    for every int32 ``q0`` (no overflow): with ``q0 = ks*qq + qr`` it reads
    ``i - t + 1 <= qq`` where ``t = floor((qr + s + 1) / ks)`` is computed in
    uint32 (``qr + s + 1 < 2**32``) and is small.
    """
    in_range = (idx >= 0) & (idx < N)
    idx_c = jnp.clip(idx, 0, max(N - 1, 0))
    if not causal:
        return in_range, idx_c
    qq_r = qq[b_rows]  # [C]
    qr_r = qr[b_rows]
    t = (
        (qr_r.astype(jnp.uint32) + s_rows.astype(jnp.uint32) + jnp.uint32(1))
        // jnp.uint32(k_stride)
    ).astype(jnp.int32)
    lhs = idx_c - (t - 1)[:, None, None]
    return in_range & (lhs <= qq_r[:, None, None]), idx_c


class ChunkScores(NamedTuple):
    """One chunk of query rows ``start .. start+C-1`` (rows of the flattened
    [B*S]) and its raw scores; ``r`` indexes the chunk's rows."""

    acc: jax.Array     # [C, HK, Hg, T] float32: q.k (bf16 products, float32 accumulation)
    valid: jax.Array   # [C, HK, T] bool: SPEC §2's slot validity
    q_rows: jax.Array  # [C, HK, Hg, D] the chunk's query rows
    kg: jax.Array      # [C, HK, T, D] gathered keys: kg[r, kh, j] = k[b_r, idx_c[r, kh, j], kh]
    idx_c: jax.Array   # [C, HK, T] int32 indices clamped into [0, N-1]
    rows: jax.Array    # [C] int32 row numbers in [0, B*S)
    b_rows: jax.Array  # [C] int32 batch element of each row


def _chunk_scores(q, k, indices, q_start, start, C: int, problem: Problem, *, causal: bool, k_stride: int):
    """The :class:`ChunkScores` of query rows ``start .. start+C-1``."""
    B, S, H, D, N, HK, T = (problem.B, problem.S, problem.H, problem.D, problem.N, problem.HK, problem.T)
    Hg = H // HK
    R = B * S
    q_flat = q.reshape(R, HK, Hg, D)
    i_flat = indices.reshape(R, HK, T)
    q_rows = jax.lax.dynamic_slice_in_dim(q_flat, start, C, axis=0)
    i_rows = jax.lax.dynamic_slice_in_dim(i_flat, start, C, axis=0)
    rows = start + jnp.arange(C, dtype=jnp.int32)
    b_rows = rows // S
    s_rows = rows - b_rows * S

    qq, qr = _causal_parts(q_start, k_stride)
    valid, idx_c = _valid_slots(i_rows, b_rows, s_rows, qq, qr, N=N, causal=causal, k_stride=k_stride)

    kh = jnp.arange(HK, dtype=jnp.int32)
    # gathered keys: kg[r, kh, j, :] = k[b_r, idx_c[r, kh, j], kh, :]
    kg = k.at[b_rows[:, None, None], idx_c, kh[None, :, None]].get(mode="promise_in_bounds")
    precision = jax.lax.Precision.HIGHEST if problem.dtype == jnp.dtype(jnp.float32) else None
    acc = jnp.einsum(
        "rkhd,rktd->rkht", q_rows, kg,
        preferred_element_type=jnp.float32, precision=precision,
    )
    return ChunkScores(acc, valid, q_rows, kg, idx_c, rows, b_rows)


def _probabilities(acc, valid, lse_rows, *, sm_scale: float, lse_base: str):
    """``(p, keep)``: p[r, kh, hh, j] per SPEC §2 from the raw dot products
    (lse_rows [C, HK, Hg]), and the mask ``keep`` (valid slot, finite lse)
    outside which p is 0."""
    finite = jnp.isfinite(lse_rows)
    lse_safe = jnp.where(finite, lse_rows, 0.0)[..., None]
    if lse_base == "e":
        p = jnp.exp(acc * jnp.float32(sm_scale) - lse_safe)
    else:
        p = jnp.exp2(acc * jnp.float32(sm_scale * LOG2E) - lse_safe)
    keep = valid[:, :, None, :] & finite[..., None]
    return jnp.where(keep, p, jnp.float32(0.0)), keep


def _group_sum(p, H: int):
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
    q, k, indices, lse, q_start, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, chunk: Optional[int] = None, **unused_params,
):
    """SPEC §2 on canonical operands: q [B,S,H,D], k [B,N,HK,D],
    indices [B,S,HK,T] int32, lse [B,S,H] float32, q_start [B] int32.
    Returns float32 [B, G, S, T]. Parameters must already be checked.

    ``chunk`` overrides the rows per chunk (tests use it to exercise the
    chunk loop on small problems). Extra keyword parameters (e.g. the
    primitive's ``implementation``) are ignored.
    """
    problem = _contract.check_canonical(q, k, indices, lse, q_start)
    B, S, H, HK, T, G = problem.B, problem.S, problem.H, problem.HK, problem.T, problem.G
    if problem.is_empty:
        return jnp.zeros(problem.canonical_out_shape, jnp.float32)
    R = B * S
    C = min(int(chunk), R) if chunk else chunk_rows(problem)
    Hg = H // HK
    lse_flat = lse.reshape(R, HK, Hg)

    def body(start):
        scores = _chunk_scores(q, k, indices, q_start, start, C, problem, causal=causal, k_stride=k_stride)
        lse_rows = jax.lax.dynamic_slice_in_dim(lse_flat, start, C, axis=0)
        p, _ = _probabilities(scores.acc, scores.valid, lse_rows, sm_scale=sm_scale, lse_base=lse_base)
        return _group_sum(p.reshape(C, H, T), H)

    out = _row_chunked(body, R, C, (G, T), jnp.float32)  # [R, G, T]
    return out.reshape(B, S, G, T).transpose(0, 2, 1, 3)


def exact_lse_canonical(
    q, k, indices, q_start, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, empty_value: float = float("inf"),
):
    """The float32 log-sum-exp, in base ``lse_base``, of ``z = sm_scale * q.k``
    over the valid slots of each (row, head) -- the ``lse`` a forward kernel
    would produce for this selection. Rows with no valid slot get
    ``empty_value`` (+inf, as FlashMLA writes). Canonical operands; returns
    [B, S, H] float32. Used by the synthetic problem generator."""
    B, S, H = (int(d) for d in q.shape[:3])
    lse_dummy = jax.ShapeDtypeStruct((B, S, H), jnp.float32)
    problem = _contract.check_canonical(q, k, indices, lse_dummy, q_start)
    if problem.is_empty:
        return jnp.full((B, S, H), empty_value, jnp.float32)
    R = B * S
    C = chunk_rows(problem)

    def body(start):
        scores = _chunk_scores(q, k, indices, q_start, start, C, problem, causal=causal, k_stride=k_stride)
        acc, valid = scores.acc, scores.valid
        z = acc * jnp.float32(sm_scale)
        z = jnp.where(valid[:, :, None, :], z, -jnp.inf)
        m = jnp.max(z, axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        lse_e = jnp.log(jnp.sum(jnp.exp(z - m_safe), axis=-1)) + m_safe[..., 0]
        any_valid = jnp.any(valid, axis=-1)[:, :, None]
        lse_b = lse_e if lse_base == "e" else lse_e * jnp.float32(LOG2E)
        return jnp.where(any_valid, lse_b, jnp.float32(empty_value)).reshape(C, -1)

    return _row_chunked(body, R, C, (H,), jnp.float32).reshape(B, S, H)


def canonicalize(problem: Problem, q, k, indices, lse, q_start_index):
    """Adds the batch dimension when absent and makes ``q_start`` int32 [B]."""
    if not problem.batched:
        q, k, indices, lse = (x[None] for x in (q, k, indices, lse))
    q, k, indices, lse = (jnp.asarray(x) for x in (q, k, indices, lse))
    if isinstance(q_start_index, int):
        q_start = jnp.full((problem.B,), q_start_index, jnp.int32)
    else:
        q_start = jnp.broadcast_to(jnp.asarray(q_start_index).astype(jnp.int32), (problem.B,))
    return q, k, indices, lse, q_start


def attn_dist_reference(
    q, k, indices, lse, *, sm_scale, causal=True, q_start_index=0, k_stride=1, lse_base="2",
):
    """The jnp reference of :func:`jax_attn_dist.attn_dist` (same arguments
    except ``implementation``; same result up to float32 rounding). Runs on any
    backend, under ``jit`` or eagerly; see ``attn_dist`` for the semantics."""
    problem = _contract.check_problem(q, k, indices, lse)
    params = _contract.check_params(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base)
    q_start_index = _contract.check_q_start_index(q_start_index, problem)
    args = canonicalize(problem, q, k, indices, lse, q_start_index)
    out = reference_canonical(*args, **params.as_dict())
    return out if problem.batched else out[0]
