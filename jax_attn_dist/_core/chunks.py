"""Row-chunked jnp building blocks, shared by every op's jnp path.

The jnp paths -- each op's reference and backward pass, and the synthetic
problem generator -- share these pieces: the chunk loop over query rows, the
slot-validity rule, the gather of the selected key rows and the raw q.k
scores. They are written to run well under XLA on a GPU: one gather and one
batched matmul (bf16 products, float32 accumulation) per chunk of query rows;
no Python loops over heads or slots; no float64.

Temporaries are bounded independently of B and S: the B*S query rows are
processed in chunks of ``C`` rows inside a ``fori_loop`` (``C`` from
:func:`chunk_rows`). The loop slices its inputs in place (no padded copy):
the last chunk starts at ``R - C`` and may overlap the previous one,
recomputing identical rows.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp


#: Bytes of per-chunk temporaries the jnp paths aim for. For attn_dist at
#: S=4096, N=8192, H=128, T=2048, D=576 bf16 this gives chunks of 96 query
#: rows and about 0.4 GiB of temporaries (XLA's count on an H100 with jax
#: 0.11.2); larger chunks gain a few percent of speed there (14.2 ms at 128
#: rows, 13.4 ms at 256 rows with 0.9 GiB).
CHUNK_BYTES = 512 << 20
MAX_CHUNK_ROWS = 1024

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
HIGHEST = jax.lax.Precision.HIGHEST


class ScoreProblem(NamedTuple):
    """The sizes the chunk code reads (each op's checked problem has them, or
    gives them as one of these): rows ``B*S``, ``H`` query heads over ``HK``
    key heads, features ``D``, ``N`` keys, ``T`` slots, the operands' dtype."""

    B: int
    S: int
    H: int
    D: int
    N: int
    HK: int
    T: int
    dtype: Any


def chunk_rows(problem, per_row_bytes: Optional[int] = None, budget: Optional[int] = None) -> int:
    """Query rows per chunk for this problem (>= 1): ``budget`` bytes
    (default :data:`CHUNK_BYTES`) of temporaries at ``per_row_bytes`` per
    query row (default: attn_dist's gathered keys plus three float32 [H, T]
    arrays)."""
    if per_row_bytes is None:
        itemsize = jnp.dtype(problem.dtype).itemsize
        per_row_bytes = problem.HK * problem.T * problem.D * itemsize + 3 * problem.H * problem.T * 4
    if budget is None:
        budget = CHUNK_BYTES
    rows = max(1, budget // max(per_row_bytes, 1))
    rows = min(rows, MAX_CHUNK_ROWS, max(problem.B * problem.S, 1))
    if rows >= 16:
        rows -= rows % 8
    return int(rows)


def row_loop(body: Callable, R: int, C: int, out_specs, carry):
    """Runs ``body`` over chunks of ``C`` of the ``R`` rows; returns
    ``(outs, carry)``. ``body(start, first_new, carry)`` computes rows
    ``start .. start + C - 1`` and returns ``(blocks, carry)``: one block
    ``[C, *tail]`` per ``(tail, dtype)`` of ``out_specs``, written into the
    output ``[R, *tail]`` at ``start``, and the updated ``carry`` (e.g. an
    accumulator). Chunks start at multiples of C except the last, at
    ``R - C``: it may overlap the previous one, whose rows (those before
    ``first_new``) it recomputes; a body that accumulates into ``carry`` must
    skip them. ``start`` and ``first_new`` are traced int32 except when there
    is one chunk; then ``body``'s blocks are returned as they are."""
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


def row_chunked(body: Callable, R: int, C: int, tail_shape, dtype):
    """Returns ``concat([body(start) for start in chunk starts])`` as an array
    ``[R, *tail_shape]``, where ``body(start)`` computes rows
    ``start .. start + C - 1`` (see :func:`row_loop`)."""
    (out,), _ = row_loop(lambda start, _, carry: ((body(start),), carry), R, C, [(tail_shape, dtype)], None)
    return out


def causal_parts(q_start, k_stride: int):
    """Splits the int32 per-batch ``q_start`` into ``qq = floor(q_start / ks)`` and
    ``qr = q_start - qq * ks`` (0 <= qr < ks), exactly, without overflow."""
    ks = jnp.int32(k_stride)
    qq = jnp.floor_divide(q_start, ks)
    qr = q_start - qq * ks  # in [0, ks): no overflow
    return qq, qr


def valid_slots(idx, b_rows, s_rows, qq, qr, ranges, *, N: int, causal: bool, k_stride: int):
    """``valid[r, kh, j]`` per SPEC §2, and the indices clamped into [0, N-1].

    ``ranges``: the rows' SPEC §6 ranges ``[C, 3]`` (``checks.ROW_RANGE_FIELDS``;
    see :func:`in_row_ranges`), which replace the §2 rule, or ``None``.

    The causal rule ``i <= floor((q0 + s + 1 - ks) / ks)`` is evaluated exactly
    for every int32 ``q0`` (no overflow): with ``q0 = ks*qq + qr`` it reads
    ``i - t + 1 <= qq`` where ``t = floor((qr + s + 1) / ks)`` is computed in
    uint32 (``qr + s + 1 < 2**32``) and is small.
    """
    idx_c = jnp.clip(idx, 0, max(N - 1, 0))
    if ranges is not None:
        return in_row_ranges(idx, ranges, N=N), idx_c
    in_range = (idx >= 0) & (idx < N)
    if not causal:
        return in_range, idx_c
    return in_range & causal_visible(idx_c, s_rows, qq[b_rows], qr[b_rows], k_stride=k_stride), idx_c


def in_row_ranges(idx, ranges, *, N: int):
    """Slot validity under SPEC §6's per-row ranges (the kernels' rule,
    csrc/common/slot_validity.cuh): ``ranges`` ``[C, 3]`` int32 holds each
    row's ``key_begin``, ``key_end`` and ``topk_length``; slot ``j`` of row
    ``r`` selecting ``idx[r, kh, j]`` is valid iff ``j < clamp(topk_length,
    0, T)`` and ``key_begin <= idx < key_end`` with ``key_begin`` clamped
    into ``[0, N]`` and ``key_end`` into ``[key_begin, N]``."""
    T = idx.shape[-1]
    begin = jnp.clip(ranges[:, 0], 0, N)
    end = jnp.clip(ranges[:, 1], begin, N)
    length = jnp.clip(ranges[:, 2], 0, T)
    j = jnp.arange(T, dtype=jnp.int32)
    return ((idx >= begin[:, None, None]) & (idx < end[:, None, None])
            & (j[None, None, :] < length[:, None, None]))


def causal_steps(offset, qr, *, k_stride: int):
    """``t = floor((qr + offset + 1) / ks)`` formed in uint32 (``qr + offset
    + 1 < 2**32``; ``qr`` from :func:`causal_parts`, ``offset`` in ``[0,
    2^31)``): a query at ``q0 + offset`` (``q0 = ks*qq + qr``) sees the key
    positions ``i <= qq + t - 1``, i.e. ``qq + t`` of them from 0."""
    return ((qr.astype(jnp.uint32) + offset.astype(jnp.uint32) + jnp.uint32(1))
            // jnp.uint32(k_stride)).astype(jnp.int32)


def visible_keys(offset, qq, qr, span, *, k_stride: int):
    """``clamp(qq + t, 0, span)`` with ``t`` from :func:`causal_steps`: how
    many of a range's first ``span`` keys (``span`` in ``[0, 2^31)``) the
    causal rule lets the query at ``q0 + offset`` see. Exact for every int32
    ``q0``, without overflow: ``clamp(qq + t, 0, span) = min(max(qq, -t),
    span - t) + t``."""
    t = causal_steps(offset, qr, k_stride=k_stride)
    return jnp.minimum(jnp.maximum(qq, -t), span - t) + t


def causal_visible(i, offset, qq, qr, *, k_stride: int):
    """The causal rule ``i <= floor((q0 + offset + 1 - ks) / ks)`` for key
    positions ``i`` [C, HK, T] (in [-2^31, 2^31 - N]) of rows at ``offset`` [C]
    (in [0, 2^31)) past a start ``q0 = ks*qq + qr`` (``qq``, ``qr`` [C], from
    :func:`causal_parts`), exactly and without overflow: it reads
    ``i - t + 1 <= qq`` with ``t = floor((qr + offset + 1) / ks)`` formed in
    uint32 (``qr + offset + 1 < 2**32``)."""
    t = causal_steps(offset, qr, k_stride=k_stride)
    return i - (t - 1)[:, None, None] <= qq[:, None, None]


class ChunkScores(NamedTuple):
    """One chunk of query rows ``start .. start+C-1`` (rows of the flattened
    [B*S]) and its raw scores; ``r`` indexes the chunk's rows."""

    acc: jax.Array     # [C, HK, Hg, T] float32: q.k (bf16 products, float32 accumulation)
    valid: jax.Array   # [C, HK, T] bool: slot validity (SPEC §2, or §6's row ranges)
    q_rows: jax.Array  # [C, HK, Hg, D] the chunk's query rows
    kg: jax.Array      # [C, HK, T, D] gathered keys: kg[r, kh, j] = k[b_r, idx_c[r, kh, j], kh]
    idx_c: jax.Array   # [C, HK, T] int32 indices clamped into [0, N-1]
    rows: jax.Array    # [C] int32 row numbers in [0, B*S)
    b_rows: jax.Array  # [C] int32 batch element of each row


def chunk_scores(q, k, indices, q_start, row_ranges, start, C: int, problem, *, causal: bool,
                 k_stride: int):
    """The :class:`ChunkScores` of query rows ``start .. start+C-1``.
    Canonical operands: q [B,S,H,D], k [B,N,HK,D], indices [B,S,HK,T],
    q_start [B], row_ranges [B,S,3] or [B,S,0] (none)."""
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

    qq, qr = causal_parts(q_start, k_stride)
    ranges = rows_of(row_ranges, start, C) if row_ranges.shape[-1] else None
    valid, idx_c = valid_slots(i_rows, b_rows, s_rows, qq, qr, ranges, N=N, causal=causal, k_stride=k_stride)

    kh = jnp.arange(HK, dtype=jnp.int32)
    # gathered keys: kg[r, kh, j, :] = k[b_r, idx_c[r, kh, j], kh, :]
    kg = k.at[b_rows[:, None, None], idx_c, kh[None, :, None]].get(mode="promise_in_bounds")
    precision = HIGHEST if problem.dtype == jnp.dtype(jnp.float32) else None
    acc = jnp.einsum(
        "rkhd,rktd->rkht", q_rows, kg,
        preferred_element_type=jnp.float32, precision=precision,
    )
    return ChunkScores(acc, valid, q_rows, kg, idx_c, rows, b_rows)


def rows_of(x, start, C: int):
    """Rows ``start .. start+C-1`` of ``x`` reshaped to ``[R, ...]`` with
    ``R = x.shape[0] * x.shape[1]`` (canonical ``[B, S, ...]`` operands)."""
    flat = x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]))
    return jax.lax.dynamic_slice_in_dim(flat, start, C, axis=0)


def probabilities(acc, valid, lse_rows, *, sm_scale: float, lse_base: str):
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


def sorted_segment_scatter_add(acc, keys, values, *, num_keys: int):
    """``acc.at[keys].add(values)`` with a fixed summation order: bitwise
    reproducible on every backend (an XLA scatter-add of colliding float
    values on a GPU uses atomics, whose order varies run to run).

    ``keys`` [M] int32 (``>= num_keys`` are dropped), ``values`` [M, ...].
    The pairs are sorted by (key, position); a segmented sum (an associative
    scan, a fixed reduction tree) totals each key's run in that order; each
    run's total is then added to ``acc`` once (no collisions)."""
    M = keys.shape[0]
    pos = jnp.arange(M, dtype=jnp.int32)
    keys_s, pos_s = jax.lax.sort((keys, pos), num_keys=2)
    vals = values[pos_s]
    starts = jnp.concatenate([jnp.ones((1,), bool), keys_s[1:] != keys_s[:-1]])

    def combine(a, b):
        fa, va = a
        fb, vb = b
        fb_b = fb.reshape(fb.shape + (1,) * (vb.ndim - fb.ndim))
        return fa | fb, jnp.where(fb_b, vb, va + vb)

    _, run_sums = jax.lax.associative_scan(combine, (starts, vals))
    ends = jnp.concatenate([keys_s[1:] != keys_s[:-1], jnp.ones((1,), bool)])
    target = jnp.where(ends, keys_s, num_keys)  # only each run's last element lands
    return acc.at[target].add(run_sums, mode="drop", unique_indices=False)
