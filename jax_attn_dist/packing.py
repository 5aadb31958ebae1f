"""Packed sequences and per-row top-k lengths (SPEC §6), by index masking.

SPEC §6 only restricts which slots are valid. This module evaluates that
restriction in plain jnp, elementwise over ``[B?, S, HK, T]``, and replaces
the index of every slot it rules out by -1, which SPEC §2 always treats as
invalid. The public functions then call the unpacked path (SPEC §2/§5) on the
masked indices:

* with ``cu_seqlens_q``/``cu_seqlens_k``: the whole §6.2 rule (sequence
  ranges, per-sequence causality, §6.3's malformed boundaries, and
  ``topk_length``) is applied here, and the unpacked path runs with
  ``causal=False, q_start_index=0``;
* with ``topk_length`` alone: only slots ``j >= clamp(topk_length, 0, T)``
  are masked; the caller's ``causal`` and ``q_start_index`` are kept.

Because the masking is ordinary jnp, jit with traced boundaries, vmap (each
example its own boundaries), S-sharding, gradients and export all go through
the existing primitives unchanged, and on a GPU the CUDA kernels serve packed
inputs as they are. :func:`slot_validity` is the one place where the rule is
written; ``jax_attn_dist.oracle`` evaluates it independently for the tests.
"""

from __future__ import annotations

from typing import Any, Tuple

import jax
import jax.numpy as jnp

from . import _contract
from ._chunks import causal_parts, causal_visible

#: The index every ruled-out slot gets (out of range, so invalid under SPEC §2).
MASKED_INDEX = -1


def _per_seq_q_start(q_start_index, num_seqs: int):
    if isinstance(q_start_index, int):
        return jnp.full((num_seqs,), q_start_index, jnp.int32)
    return jnp.broadcast_to(jnp.asarray(q_start_index).astype(jnp.int32), (num_seqs,))


def row_sequences(cu_seqlens_q, cu_seqlens_k, *, S: int, N: int):
    """Which sequence each query row belongs to (SPEC §6.2, §6.3).

    Sequence ``b`` *claims* row ``s`` when ``cu_seqlens_q[b] <= s <
    cu_seqlens_q[b + 1]``; it is *well-formed* when ``0 <= cu_seqlens_q[b] <=
    cu_seqlens_q[b + 1] <= S`` and ``0 <= cu_seqlens_k[b] <= cu_seqlens_k[b +
    1] <= N``. Row ``s`` belongs to ``b`` when ``b`` is the only sequence that
    claims it and ``b`` is well-formed; otherwise it belongs to no sequence.

    Returns ``(ok [S] bool, owner [S] int32)``: ``ok[s]`` says whether row
    ``s`` belongs to a sequence, ``owner[s]`` is that sequence (0 where not
    ``ok``). The lookup compares every row with every boundary (a fused
    compare-and-reduce, O(S * num_seqs) work, elementwise in S)."""
    cu_q = jnp.asarray(cu_seqlens_q).astype(jnp.int32)
    cu_k = jnp.asarray(cu_seqlens_k).astype(jnp.int32)
    lo, hi = cu_q[:-1], cu_q[1:]
    klo, khi = cu_k[:-1], cu_k[1:]
    well = (lo >= 0) & (lo <= hi) & (hi <= S) & (klo >= 0) & (klo <= khi) & (khi <= N)  # [num_seqs]
    s = jnp.arange(S, dtype=jnp.int32)[:, None]
    claims = (lo[None, :] <= s) & (s < hi[None, :])                                   # [S, num_seqs]
    if lo.shape[0] == 0:
        return jnp.zeros((S,), bool), jnp.zeros((S,), jnp.int32)
    count = jnp.sum(claims, axis=1, dtype=jnp.int32)
    owner = jnp.argmax(claims, axis=1).astype(jnp.int32)  # the claimer, when there is exactly one
    ok = (count == 1) & well[owner]
    return ok, jnp.where(ok, owner, 0)


def slot_validity(indices, *, N: int, causal: bool, k_stride: int, q_start_index: Any = 0, topk_length=None,
                  cu_seqlens_q=None, cu_seqlens_k=None):
    """SPEC §6's restriction of the slots of ``indices`` ``[B?, S, HK, T]``
    (bool, same shape).

    With ``cu_seqlens_q``/``cu_seqlens_k`` (unbatched ``indices``) this is the
    complete validity of §6.2: the index lies in the key range of the row's
    sequence and, when ``causal``, satisfies the causal rule relative to the
    sequence (``q_start_index``: int or int32 ``[]``/``[num_seqs]``, the
    position of each sequence's first query row); rows outside every
    sequence (padding, §6.3's malformed boundaries) have no valid slot.
    Without them it is only the ``topk_length`` condition (the caller's §2
    rule still applies on top). ``topk_length`` ``[B?, S]``: slot ``j`` is
    valid only if ``j < clamp(topk_length, 0, T)``.

    The causal rule ``i - cu_k[b] <= floor((pos + 1 - ks) / ks)`` with
    ``pos = s - cu_q[b] + q_start[b]`` is evaluated exactly for every int32
    value by ``_chunks.causal_visible`` (the unpacked rule's own), with
    ``d = s - cu_q[b]`` in ``[0, S)`` as the row offset and ``i'``, the
    clamped index minus ``cu_k[b]``, as the key position."""
    idx = jnp.asarray(indices)
    T = idx.shape[-1]
    valid = None
    if topk_length is not None:
        length = jnp.clip(jnp.asarray(topk_length).astype(jnp.int32), 0, T)
        j = jnp.arange(T, dtype=jnp.int32)
        valid = j < length[..., None, None]
    if cu_seqlens_q is None:
        return valid if valid is not None else jnp.ones(idx.shape, bool)

    S = idx.shape[-3]
    num_seqs = int(cu_seqlens_q.shape[0]) - 1
    if num_seqs == 0:
        return jnp.zeros(idx.shape, bool)
    ok, owner = row_sequences(cu_seqlens_q, cu_seqlens_k, S=S, N=N)
    cu_q = jnp.asarray(cu_seqlens_q).astype(jnp.int32)
    cu_k = jnp.asarray(cu_seqlens_k).astype(jnp.int32)
    k_lo = jnp.where(ok, cu_k[owner], 0)[:, None, None]   # [S, 1, 1], in [0, N] where ok
    k_hi = jnp.where(ok, cu_k[owner + 1], 0)[:, None, None]
    in_seq = ok[:, None, None] & (idx >= k_lo) & (idx < k_hi)
    if causal:
        qq, qr = causal_parts(_per_seq_q_start(q_start_index, num_seqs), k_stride)
        s = jnp.arange(S, dtype=jnp.int32)
        d = jnp.where(ok, s - cu_q[owner], 0)              # row's offset in its sequence, in [0, S)
        i_rel = jnp.clip(idx, 0, max(N - 1, 0)) - k_lo     # in [-N, N)
        in_seq = in_seq & causal_visible(i_rel, d, qq[owner], qr[owner], k_stride=k_stride)
    return in_seq if valid is None else in_seq & valid


def restrict_indices(indices, packing: "_contract.Packing", *, N: int, causal: bool,
                     k_stride: int) -> Tuple[Any, bool, Any]:
    """The unpacked call equivalent to SPEC §6: ``(indices, causal,
    q_start_index)`` to pass to the SPEC §2/§5 path, with every slot §6 rules
    out set to :data:`MASKED_INDEX`. Without §6 keywords, the arguments as
    they are."""
    if not packing.active:
        return indices, causal, packing.q_start_index
    valid = slot_validity(indices, N=N, causal=causal, k_stride=k_stride, q_start_index=packing.q_start_index,
                          topk_length=packing.topk_length, cu_seqlens_q=packing.cu_seqlens_q,
                          cu_seqlens_k=packing.cu_seqlens_k)
    masked = jnp.where(valid, indices, jnp.int32(MASKED_INDEX))
    if packing.packed:
        return masked, False, 0
    return masked, causal, packing.q_start_index


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
