"""Packed sequences and per-row top-k lengths (SPEC §6), as per-row ranges.

SPEC §6 only restricts which slots are valid, and for every query row the
restriction has one form: the row's valid keys are one contiguous range
``[key_begin, key_end)`` (its sequence's keys, cut by the causal rule
relative to the sequence) and its live slots are ``[0, topk_length)``. This
module turns the §6 keywords into those ranges, an int32 ``[B?, S, 3]``
array (``checks.ROW_RANGE_FIELDS``), in XLA on the device: no host sync,
traced boundaries welcome. The primitives take the ranges as an operand
(``row_ranges``) in place of SPEC §2's causal rule, and every path applies
them the same way: the CUDA kernels per row (csrc/common/slot_validity.cuh:
slots past ``topk_length`` are skipped as whole blocks and the key test is
one compare), the jnp paths through ``_chunks.in_row_ranges``.

Finding each row's sequence under §6.3's malformed-boundary rule (a row
belongs to ``b`` only if ``b`` is its only claimer and is well-formed) needs
every boundary, so it is done here once for all rows rather than per row in
a kernel (see :func:`row_sequences`). Rows only ever see their own ranges, so
S-sharding, vmap (each example its own boundaries), gradients and export go
through the primitives unchanged.

:func:`row_ranges` is the one place where §6 is written;
``jax_attn_dist.oracle`` evaluates it independently for the tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from .chunks import causal_parts, visible_keys


#: Row-sequence pairs up to which row_sequences compares every row with every
#: boundary in one fused kernel (e.g. S = 4096 rows with up to 1024 sequences);
#: past it, difference arrays keep the work O(S + num_seqs).
FUSED_CLAIMS = 1 << 22


@dataclasses.dataclass(frozen=True)
class Packing:
    """The checked SPEC §6 keywords of one call (arrays as given, not yet
    cast). ``packed``: cu_seqlens were given (then ``q_start_index`` is an int
    or an array of shape [] or [num_seqs]); ``active``: any §6 keyword was."""

    topk_length: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    q_start_index: Any = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def active(self) -> bool:
        return self.packed or self.topk_length is not None

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens_q.shape[0]) - 1 if self.packed else 0


def check_packing(topk_length, cu_seqlens_q, cu_seqlens_k, q_start_index, problem, who: str) -> Packing:
    """Validates SPEC §6's keywords together with ``q_start_index`` (which,
    with cu_seqlens, is per sequence rather than per batch element).
    ``problem``: a :class:`Problem` or :class:`IndexerProblem`."""
    lead = (problem.B,) if problem.batched else ()
    if topk_length is not None:
        checks.check_int_array("topk_length", topk_length, who, "of shape [B?, S]")
        shape = tuple(int(d) for d in topk_length.shape)
        want = lead + (problem.S,)
        if shape != want:
            names = "[B, S]" if problem.batched else "[S]"
            raise ValueError(f"{who}: `topk_length` must have shape {names} = {checks.fmt_shape(want)} (one length per query "
                             f"row), got {checks.fmt_shape(shape)}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        given, missing = ("cu_seqlens_q", "cu_seqlens_k") if cu_seqlens_k is None else ("cu_seqlens_k",
                                                                                         "cu_seqlens_q")
        raise ValueError(f"{who}: `{given}` was given without `{missing}`: the packed-sequence boundaries of the "
                         "queries and of the keys are given together (pass the same array twice when q and k "
                         "share one layout)")
    if cu_seqlens_q is None:
        return Packing(topk_length=topk_length, q_start_index=checks.check_q_start_index(q_start_index, problem, who))
    if problem.batched:
        raise ValueError(f"{who}: `cu_seqlens_q`/`cu_seqlens_k` are accepted only with unbatched inputs (packed "
                         f"sequences share one row of tokens); the inputs carry a batch dimension B = {problem.B} "
                         "(use jax.vmap to give each example its own boundaries)")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        checks.check_int_array(name, x, who, "of shape [num_seqs + 1]")
        if x.ndim != 1 or int(x.shape[0]) < 1:
            raise ValueError(f"{who}: `{name}` must have shape [num_seqs + 1] (rank 1, at least one entry), got "
                             f"{checks.fmt_shape(x.shape)}")
    if tuple(cu_seqlens_q.shape) != tuple(cu_seqlens_k.shape):
        raise ValueError(f"{who}: `cu_seqlens_q` and `cu_seqlens_k` must have the same shape [num_seqs + 1], got "
                         f"{checks.fmt_shape(cu_seqlens_q.shape)} and {checks.fmt_shape(cu_seqlens_k.shape)}")
    q_start_index = checks.check_q_start_index(q_start_index, problem, who, num_seqs=int(cu_seqlens_q.shape[0]) - 1)
    return Packing(topk_length=topk_length, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   q_start_index=q_start_index)


def check_num_seqs(num_seqs: Any, who: str = "cu_seqlens_from_segment_ids") -> int:
    if isinstance(num_seqs, (bool, np.bool_)) or not isinstance(num_seqs, (int, np.integer)):
        raise TypeError(f"{who}: `num_seqs` must be a Python int >= 0 (static), got "
                        f"{type(num_seqs).__name__}: {num_seqs!r}")
    value = int(num_seqs)
    if not (0 <= value < checks.INT32_MAX):
        raise ValueError(f"{who}: `num_seqs` must be an int >= 0, got {value}")
    return value


def check_segment_ids(segment_ids: Any, who: str = "cu_seqlens_from_segment_ids"):
    checks.check_int_array("segment_ids", segment_ids, who, "of shape [S] or [B, S]")
    if segment_ids.ndim not in (1, 2):
        raise ValueError(f"{who}: `segment_ids` must have rank 1 [S] or rank 2 [B, S], got shape "
                         f"{checks.fmt_shape(segment_ids.shape)}")
    return segment_ids


def _int32_as(x, shape):
    """A checked ``q_start_index`` (a Python int, or an integer array of shape
    [] or ``shape``) as int32 of ``shape``."""
    return jnp.broadcast_to(jnp.asarray(x).astype(jnp.int32), shape)


def row_sequences(cu_seqlens_q, cu_seqlens_k, *, S: int, N: int):
    """Which sequence each query row belongs to (SPEC §6.2, §6.3).

    Sequence ``b`` *claims* row ``s`` when ``cu_seqlens_q[b] <= s <
    cu_seqlens_q[b + 1]``; it is *well-formed* when ``0 <= cu_seqlens_q[b] <=
    cu_seqlens_q[b + 1] <= S`` and ``0 <= cu_seqlens_k[b] <= cu_seqlens_k[b +
    1] <= N``. Row ``s`` belongs to ``b`` when ``b`` is the only sequence that
    claims it and ``b`` is well-formed; otherwise it belongs to no sequence.

    Returns ``(ok [S] bool, owner [S] int32)``: ``ok[s]`` says whether row
    ``s`` belongs to a sequence, ``owner[s]`` is that sequence (0 where not
    ``ok``). Per row: the number of claimers and the sum of their ids, which
    is the claimer where there is one (int32 wrap-around cancels exactly).
    Up to :data:`FUSED_CLAIMS` row-sequence pairs they come from one fused
    compare-and-reduce over ``[S, num_seqs]`` (one XLA kernel); beyond, from
    difference arrays: each claim ``[lo, hi)`` adds 1 and ``b`` at ``lo`` and
    takes them off at ``hi``, and a cumsum over the rows totals them (O(S +
    num_seqs) work, a few kernels)."""
    cu_q = jnp.asarray(cu_seqlens_q).astype(jnp.int32)
    cu_k = jnp.asarray(cu_seqlens_k).astype(jnp.int32)
    num_seqs = int(cu_q.shape[0]) - 1  # >= 1: row_ranges serves num_seqs = 0 itself
    lo, hi = cu_q[:-1], cu_q[1:]
    klo, khi = cu_k[:-1], cu_k[1:]
    well = (lo >= 0) & (lo <= hi) & (hi <= S) & (klo >= 0) & (klo <= khi) & (khi <= N)  # [num_seqs]
    b = jnp.arange(num_seqs, dtype=jnp.int32)
    if S * num_seqs <= FUSED_CLAIMS:
        s = jnp.arange(S, dtype=jnp.int32)[:, None]
        claims = (lo[None, :] <= s) & (s < hi[None, :])                                # [S, num_seqs]
        count = jnp.sum(claims, axis=1, dtype=jnp.int32)
        ids = jnp.sum(jnp.where(claims, b[None, :], 0), axis=1, dtype=jnp.int32)
    else:
        a, e = jnp.clip(lo, 0, S), jnp.clip(hi, 0, S)
        claims = a < e
        at = jnp.concatenate([jnp.where(claims, a, S), jnp.where(claims, e, S)])  # index S: past the rows
        count_delta = jnp.concatenate([jnp.ones_like(b), -jnp.ones_like(b)])
        id_delta = jnp.concatenate([b, -b])
        count = jnp.cumsum(jnp.zeros((S + 1,), jnp.int32).at[at].add(count_delta)[:S], dtype=jnp.int32)
        ids = jnp.cumsum(jnp.zeros((S + 1,), jnp.int32).at[at].add(id_delta)[:S], dtype=jnp.int32)
    owner = jnp.clip(ids, 0, num_seqs - 1)  # the claimer where count == 1
    ok = (count == 1) & well[owner]
    return ok, jnp.where(ok, owner, 0)


def row_ranges(packing: "Packing", *, S: int, N: int, T: int, causal: bool, k_stride: int,
               batch: Optional[int] = None):
    """SPEC §6's per-row ranges, int32 ``[B?, S, 3]`` (``batch``: B, or None
    for unbatched inputs): each row's ``key_begin``, ``key_end`` and
    ``topk_length`` (see ``checks.ROW_RANGE_FIELDS``). They hold the whole
    validity rule of the call, SPEC §2's causal rule included, so the
    primitives run with ``causal=False`` beside them. ``None`` when the call
    has no §6 keyword.

    * With ``cu_seqlens_q``/``cu_seqlens_k`` (unbatched): a row of sequence
      ``b`` gets ``[cu_k[b], cu_k[b] + v)`` with ``v`` the keys of its
      sequence visible to it (all ``cu_k[b+1] - cu_k[b]`` when not causal;
      ``pos = s - cu_q[b] + q_start[b]``); a row of no sequence gets the
      empty range.
    * With ``topk_length`` alone: ``[0, N)``, or when causal ``[0, v)`` with
      ``v`` the visible keys of ``pos = q_start + s``.
    * ``topk_length``: as given (clamped into ``[0, T]``), else ``T``.
    """
    if not packing.active:
        return None
    lead = () if batch is None else (batch,)
    s = jnp.arange(S, dtype=jnp.int32)
    # Each row's key range [begin, begin + span) before the causal cut, its
    # offset from its sequence's first query and that query's position q0.
    if not packing.packed:
        begin, span, offset = jnp.zeros((), jnp.int32), jnp.int32(N), s
        q0 = _int32_as(packing.q_start_index, lead)[..., None]  # [B?, 1]
    elif packing.num_seqs == 0:
        begin = span = offset = q0 = jnp.zeros((S,), jnp.int32)  # no sequence: every range empty
    else:
        ok, owner = row_sequences(packing.cu_seqlens_q, packing.cu_seqlens_k, S=S, N=N)
        cu_q = jnp.asarray(packing.cu_seqlens_q).astype(jnp.int32)
        cu_k = jnp.asarray(packing.cu_seqlens_k).astype(jnp.int32)
        begin = jnp.where(ok, cu_k[owner], 0)                     # in [0, N]
        span = jnp.where(ok, cu_k[owner + 1], 0) - begin          # in [0, N] where ok, else 0
        offset = jnp.where(ok, s - cu_q[owner], 0)                # in [0, S)
        q0 = _int32_as(packing.q_start_index, (packing.num_seqs,))[owner]
    if causal:
        qq, qr = causal_parts(q0, k_stride)
        span = visible_keys(offset, qq, qr, span, k_stride=k_stride)
    if packing.topk_length is not None:
        length = jnp.clip(jnp.asarray(packing.topk_length).astype(jnp.int32), 0, T)
    else:
        length = jnp.int32(T)
    begin, end, length = (jnp.broadcast_to(x, lead + (S,)) for x in (begin, begin + span, length))
    return jnp.stack([begin, end, length], axis=-1)


def cu_seqlens_from_segment_ids(segment_ids, num_seqs: int):
    """``cu_seqlens`` int32 ``[num_seqs + 1]`` (``[B, num_seqs + 1]`` for
    ``[B, S]`` ids) from per-token segment ids, for SPEC §6.

    Convention: ``segment_ids[s]`` is the 0-based number of the sequence
    token ``s`` belongs to, the tokens laid out as packing produces them
    (sequence 0's tokens, then sequence 1's, ...), and padding tokens, at the
    end, carry a negative id (e.g. -1). Then ``cu_seqlens[b]`` is the number
    of tokens with an id in ``[0, b)``: sequence ``b`` is rows
    ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1`` and the padding rows lie at or
    past ``cu_seqlens[-1]``, so they give 0. ``num_seqs`` is static (the
    shape stays fixed): sequences that do not occur are empty; ids ``>=
    num_seqs`` are counted as padding, so ``num_seqs`` must exceed the
    largest id. (MaxText/splash number segments from 1 with 0 for padding:
    pass ``segment_ids - 1``.) Works under jit and vmap."""
    num_seqs = check_num_seqs(num_seqs)
    ids = check_segment_ids(segment_ids)
    ids = jnp.asarray(ids).astype(jnp.int32)

    def one(row):
        slot = jnp.where((row >= 0) & (row < num_seqs), row, num_seqs)
        counts = jnp.zeros((num_seqs,), jnp.int32).at[slot].add(1, mode="drop")
        return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])

    return one(ids) if ids.ndim == 1 else jax.vmap(one)(ids)


def rule_operands(problem, packed: Packing, *params):
    """``(q_start_index, row_ranges, *params)`` for a canonical call: with §6
    keywords, SPEC §6's per-row ranges (canonical ``[B, S, 3]``), which hold
    the whole rule, ``q_start_index=0`` and each of ``params`` (dataclasses
    with a ``causal`` field) with ``causal=False``; else ``[B, S, 0]`` and
    the caller's rule as given. ``problem``: any op's checked problem (``B``,
    ``S``, ``N``, ``T``, ``batched``)."""
    ranges = row_ranges(packed, S=problem.S, N=problem.N, T=problem.T, causal=params[0].causal,
                        k_stride=params[0].k_stride, batch=problem.B if problem.batched else None)
    if ranges is None:
        return (packed.q_start_index, checks.no_row_ranges(problem.B, problem.S), *params)
    return (0, ranges if problem.batched else ranges[None], *(dataclasses.replace(p, causal=False) for p in params))
