"""Packed sequences and per-row top-k lengths (SPEC §6), as per-row ranges.

SPEC §6 only restricts which slots are valid, and for every query row the
restriction has one form: the row's valid keys are one contiguous range
``[key_begin, key_end)`` (its sequence's keys, cut by the causal rule
relative to the sequence) and its live slots are ``[0, topk_length)``. This
module turns the §6 keywords into those ranges, an int32 ``[B?, S, 3]``
array (``_contract.ROW_RANGE_FIELDS``), in XLA on the device: no host sync,
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

from typing import Optional

import jax
import jax.numpy as jnp

from . import _contract
from ._chunks import causal_parts, visible_keys


#: Row-sequence pairs up to which row_sequences compares every row with every
#: boundary in one fused kernel (e.g. S = 4096 rows with up to 1024 sequences);
#: past it, difference arrays keep the work O(S + num_seqs).
FUSED_CLAIMS = 1 << 22


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


def row_ranges(packing: "_contract.Packing", *, S: int, N: int, T: int, causal: bool, k_stride: int,
               batch: Optional[int] = None):
    """SPEC §6's per-row ranges, int32 ``[B?, S, 3]`` (``batch``: B, or None
    for unbatched inputs): each row's ``key_begin``, ``key_end`` and
    ``topk_length`` (see ``_contract.ROW_RANGE_FIELDS``). They hold the whole
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
    num_seqs = _contract.check_num_seqs(num_seqs)
    ids = _contract.check_segment_ids(segment_ids)
    ids = jnp.asarray(ids).astype(jnp.int32)

    def one(row):
        slot = jnp.where((row >= 0) & (row < num_seqs), row, num_seqs)
        counts = jnp.zeros((num_seqs,), jnp.int32).at[slot].add(1, mode="drop")
        return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])

    return one(ids) if ids.ndim == 1 else jax.vmap(one)(ids)
