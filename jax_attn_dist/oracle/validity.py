"""SPEC §2's and §6's index-validity rule in float64 NumPy, and the exact
input conversions every oracle module uses."""

from __future__ import annotations

import numpy as np


def to_f64(x) -> np.ndarray:
    """Exact float64 copy of a bf16/f16/f32 array (jax or numpy)."""
    return np.asarray(x).astype(np.float32).astype(np.float64)


def q_start_of(q_start_index, B, packing):
    """q_start_index as int64: per batch element [B], or as given (an int or
    a per-sequence array) with SPEC §6's cu_seqlens."""
    if packing.get("cu_seqlens_q") is not None:
        return q_start_index
    return np.broadcast_to(np.asarray(q_start_index).astype(np.int64), (B,))


def prepare(q, k, indices, q_start_index, packing=None):
    q, k = to_f64(q), np.asarray(k)  # k stays in its dtype: only gathered rows are widened
    idx = np.asarray(indices).astype(np.int64)
    batched = q.ndim == 4
    if not batched:
        q, k, idx = q[None], k[None], idx[None]
    B = q.shape[0]
    return batched, q, k, idx, q_start_of(q_start_index, B, packing or {})


def valid_mask(indices, N, *, causal, q_start_index, k_stride, topk_length=None, cu_seqlens_q=None,
               cu_seqlens_k=None):
    """bool [B, S, HK, T] (canonical, batched) per SPEC §2, restricted by
    SPEC §6 when ``topk_length`` ([B?, S]) or ``cu_seqlens_q``/``_k`` (then
    B = 1, and ``q_start_index`` is an int or a per-sequence array) are
    given."""
    idx = np.asarray(indices).astype(np.int64)
    B, S, HK, T = idx.shape
    if cu_seqlens_q is not None:
        assert B == 1, "cu_seqlens: unbatched problems only"
        valid = packed_valid_mask(idx[0], N, causal=causal, q_start_index=q_start_index, k_stride=k_stride,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)[None]
    else:
        q_start = np.broadcast_to(np.asarray(q_start_index).astype(np.int64), (B,))
        valid = (idx >= 0) & (idx < N)
        if causal:
            s = np.arange(S, dtype=np.int64)
            limit = (q_start[:, None] + s[None, :] + 1 - k_stride) // k_stride  # floor
            valid &= idx <= limit[:, :, None, None]
    if topk_length is not None:
        # SPEC §6.1: slot j valid only if j < clamp(topk_length[s], 0, T)
        length = np.clip(np.asarray(topk_length).astype(np.int64).reshape(B, S), 0, T)
        valid &= np.arange(T)[None, None, None, :] < length[:, :, None, None]
    return valid


def packed_owner(cu_seqlens_q, cu_seqlens_k, S, N):
    """SPEC §6.2/§6.3, row by row: a list of S entries, the sequence b row s
    belongs to, or None (padding or a malformed boundary). A sequence b
    claims row s when cu_q[b] <= s < cu_q[b+1]; it is well-formed when
    0 <= cu_q[b] <= cu_q[b+1] <= S and 0 <= cu_k[b] <= cu_k[b+1] <= N; a
    row belongs to b when b is its only claimer and is well-formed."""
    cu_q = [int(x) for x in np.asarray(cu_seqlens_q).reshape(-1)]
    cu_k = [int(x) for x in np.asarray(cu_seqlens_k).reshape(-1)]
    num_seqs = len(cu_q) - 1
    well = [0 <= cu_q[b] <= cu_q[b + 1] <= S and 0 <= cu_k[b] <= cu_k[b + 1] <= N for b in range(num_seqs)]
    owner = []
    for s in range(S):
        claimers = [b for b in range(num_seqs) if cu_q[b] <= s < cu_q[b + 1]]
        owner.append(claimers[0] if len(claimers) == 1 and well[claimers[0]] else None)
    return owner


def packed_valid_mask(indices, N, *, causal, q_start_index, k_stride, cu_seqlens_q, cu_seqlens_k):
    """bool [S, HK, T] for unbatched ``indices`` per SPEC §6.2 (without
    topk_length), in Python integers."""
    idx = np.asarray(indices).astype(np.int64)
    S, HK, T = idx.shape
    cu_q = [int(x) for x in np.asarray(cu_seqlens_q).reshape(-1)]
    cu_k = [int(x) for x in np.asarray(cu_seqlens_k).reshape(-1)]
    num_seqs = len(cu_q) - 1
    if isinstance(q_start_index, (int, np.integer)) or np.ndim(q_start_index) == 0:
        starts = [int(q_start_index)] * num_seqs
    else:
        starts = [int(x) for x in np.asarray(q_start_index).reshape(-1)]
    valid = np.zeros((S, HK, T), bool)
    for s, b in enumerate(packed_owner(cu_q, cu_k, S, N)):
        if b is None:
            continue  # padding, or a row touched by a malformed boundary: no valid slot
        pos = s - cu_q[b] + starts[b]
        for kh in range(HK):
            for j in range(T):
                i = int(idx[s, kh, j])
                ok = cu_k[b] <= i < cu_k[b + 1]
                if ok and causal:
                    ok = i - cu_k[b] <= (pos + 1 - k_stride) // k_stride  # Python: exact, floor
                valid[s, kh, j] = ok
    return valid
