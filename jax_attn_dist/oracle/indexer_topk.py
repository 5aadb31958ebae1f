"""indexer_topk (SPEC §9, with §6) in float64 NumPy: every key's logit per
row, the exact selection, and SPEC §9.3's acceptance rule for a computed
selection."""

from __future__ import annotations

import numpy as np

from .validity import packed_owner, to_f64

#: SPEC §9.3: a selection may differ from the float64 one only among keys
#: whose float64 logits lie within TOPK_TOLERANCE * max |logit| of the cut.
TOPK_TOLERANCE = 1e-5

#: The band of the CUDA kernel with float8 inputs (SPEC §9.3): its tensor
#: cores sum float8 products with fewer mantissa bits than float32.
TOPK_TOLERANCE_FP8_KERNEL = 2.5e-4


def _key_ranges(S, N, B, *, causal, q_start_index, k_stride, cu_seqlens_q, cu_seqlens_k):
    """(begin, end) int64 [B, S]: row s's valid keys are begin <= n < end
    (SPEC §2's rule, or SPEC §6.2/§6.3's for packed rows), in Python/int64
    integers with floor division."""
    begin = np.zeros((B, S), np.int64)
    end = np.full((B, S), N, np.int64)
    if cu_seqlens_q is not None:
        assert B == 1, "cu_seqlens: unbatched problems only"
        cu_q = [int(x) for x in np.asarray(cu_seqlens_q).reshape(-1)]
        cu_k = [int(x) for x in np.asarray(cu_seqlens_k).reshape(-1)]
        num_seqs = len(cu_q) - 1
        if np.ndim(q_start_index) == 0:
            starts = [int(q_start_index)] * num_seqs
        else:
            starts = [int(x) for x in np.asarray(q_start_index).reshape(-1)]
        for s, b in enumerate(packed_owner(cu_q, cu_k, S, N)):
            if b is None:
                begin[0, s] = end[0, s] = 0
                continue
            begin[0, s], end[0, s] = cu_k[b], cu_k[b + 1]
            if causal:
                pos = s - cu_q[b] + starts[b]
                last = cu_k[b] + (pos + 1 - k_stride) // k_stride  # the last visible key
                end[0, s] = max(begin[0, s], min(end[0, s], last + 1))
        return begin, end
    if causal:
        q_start = np.broadcast_to(np.asarray(q_start_index).astype(np.int64), (B,))
        s = np.arange(S, dtype=np.int64)
        last = (q_start[:, None] + s[None, :] + 1 - k_stride) // k_stride  # floor
        end = np.clip(last + 1, 0, N)
    return begin, end


def indexer_topk_logits_oracle(index_q, index_k, weights, *, scale=1.0, causal=True, q_start_index=0, k_stride=1,
                               index_k_scale=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """float64 ``[B?, S, N]``: SPEC §9's logit of every key for every row,
    ``-inf`` where the key is not valid for the row::

        logit(s, n) = scale * sum_h weights[s, h] * relu((index_q[s, h] . index_k[n]) * index_k_scale[n])
    """
    iq, ik, w = to_f64(index_q), to_f64(index_k), to_f64(weights)
    batched = iq.ndim == 4
    if not batched:
        iq, ik, w = iq[None], ik[None], w[None]
    B, S = iq.shape[:2]
    N = ik.shape[1]
    HI, DI = iq.shape[2:]
    ks = np.ones((B, N)) if index_k_scale is None else np.asarray(index_k_scale, np.float64).reshape(B, N)
    logits = np.zeros((B, S, N))
    rows = max(1, (1 << 23) // max(HI * N, 1))  # about 64 MB of float64 scores at a time
    for b in range(B):
        for s0 in range(0, S, rows):
            q = iq[b, s0:s0 + rows]
            z = (q.reshape(-1, DI) @ ik[b].T).reshape(q.shape[0], HI, N) * ks[b]
            logits[b, s0:s0 + rows] = scale * (w[b, s0:s0 + rows, None, :] @ np.maximum(z, 0.0))[:, 0]
    begin, end = _key_ranges(S, N, B, causal=causal, q_start_index=q_start_index, k_stride=k_stride,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    n = np.arange(N)
    valid = (n[None, None, :] >= begin[..., None]) & (n[None, None, :] < end[..., None])
    logits = np.where(valid, logits, -np.inf)
    return logits if batched else logits[0]


def exact_topk(row_logits, topk):
    """The exact selection of one row (float64 logits [N], -inf where not
    valid): int64 [topk], the valid keys with the largest logits, ties
    towards the smaller key, ascending, then -1."""
    row_logits = np.asarray(row_logits, np.float64)
    keys = np.flatnonzero(row_logits > -np.inf)
    order = sorted(keys.tolist(), key=lambda n: (-row_logits[n], n))[:topk]
    out = np.full((topk,), -1, np.int64)
    out[:len(order)] = sorted(order)
    return out


def _row_cut(row_logits, topk):
    """SPEC §9.3's terms of one float64 row: (valid mask, k = min(topk,
    valid keys), the cut = the k-th largest valid logit, max |valid logit|);
    the cut and the scale are None and 0 when no key is valid."""
    valid = row_logits > -np.inf
    k = min(topk, int(valid.sum()))
    if k == 0:
        return valid, 0, None, 0.0
    vals = row_logits[valid]
    return valid, k, np.sort(vals)[::-1][k - 1], np.abs(vals).max()


def topk_selection_error(row_logits, selection, topk, rtol=TOPK_TOLERANCE):
    """None when ``selection`` (int [topk]) is an acceptable selection for a
    row whose float64 logits are ``row_logits`` ([N], -inf where a key is
    not valid) under SPEC §9.3, else a sentence saying why not:

    * it holds ``k = min(topk, number of valid keys)`` valid keys, strictly
      ascending, then ``topk - k`` entries -1;
    * with ``cut`` the k-th largest valid logit and ``tol = rtol * max
      |valid logit|``, every selected key has a logit ``>= cut - tol`` and
      every valid key left out a logit ``<= cut + tol`` (so the set differs
      from the exact one only among keys within ``tol`` of the cut)."""
    row_logits = np.asarray(row_logits, np.float64)
    sel = np.asarray(selection).astype(np.int64).reshape(-1)
    if sel.shape != (topk,):
        return f"selection has shape {sel.shape}, expected ({topk},)"
    N = row_logits.shape[0]
    valid, k, cut, scale = _row_cut(row_logits, topk)
    head, tail = sel[:k], sel[k:]
    if np.any(tail != -1):
        return f"entries past the first {k} (the number of selectable keys) must be -1, got {tail.tolist()}"
    if k == 0:
        return None
    if np.any((head < 0) | (head >= N)):
        return f"the first {k} entries must be keys in [0, {N}), got {head.tolist()}"
    if np.any(np.diff(head) <= 0):
        return f"the keys must be strictly ascending, got {head.tolist()}"
    if not np.all(valid[head]):
        return f"invalid keys selected: {head[~valid[head]].tolist()}"
    tol = rtol * scale
    chosen = np.zeros(N, bool)
    chosen[head] = True
    low = head[row_logits[head] < cut - tol]
    if low.size:
        return (f"selected keys {low.tolist()} have logits {row_logits[low].tolist()} below the cut {cut!r} "
                f"by more than {tol:.3g}")
    high = np.flatnonzero(valid & ~chosen & (row_logits > cut + tol))
    if high.size:
        return (f"keys {high[:8].tolist()} with logits {row_logits[high[:8]].tolist()} above the cut {cut!r} "
                f"by more than {tol:.3g} were left out")
    return None


def selection_band(row_logits, selection, topk):
    """The smallest ``rtol`` under which a structurally valid ``selection``
    is acceptable for ``row_logits`` (SPEC §9.3): how far, relative to the
    row's max |valid logit|, its set reaches across the cut (0 when it is
    the exact set, or a tie's other choice)."""
    row_logits = np.asarray(row_logits, np.float64)
    valid, k, cut, scale = _row_cut(row_logits, topk)
    if k == 0:
        return 0.0
    head = np.asarray(selection).astype(np.int64).reshape(-1)[:k]
    chosen = np.zeros(row_logits.shape[0], bool)
    chosen[head] = True
    below = cut - row_logits[head].min()
    left = row_logits[valid & ~chosen]
    above = (left.max() - cut) if left.size else 0.0
    return float(max(below, above, 0.0) / scale) if scale > 0 else 0.0


def assert_topk_acceptable(indices, logits, topk, rtol=TOPK_TOLERANCE):
    """Every row of ``indices`` (int [..., S, 1, topk] or [..., S, topk]) is
    acceptable for the float64 ``logits`` ([..., S, N], from
    :func:`indexer_topk_logits_oracle`) under SPEC §9.3."""
    logits = np.asarray(logits, np.float64)
    sel = np.asarray(indices).reshape(logits.shape[:-1] + (topk,))
    bad = []
    for pos in np.ndindex(*logits.shape[:-1]):
        why = topk_selection_error(logits[pos], sel[pos], topk, rtol)
        if why is not None:
            bad.append(f"row {pos}: {why}")
    if bad:
        worst = max(selection_band(logits[pos], sel[pos], topk) for pos in np.ndindex(*logits.shape[:-1]))
        raise AssertionError(f"{len(bad)} of {int(np.prod(logits.shape[:-1]))} rows unacceptable (the widest "
                             f"band needed: {worst:.3g}, allowed {rtol:.3g}); first: " + "; ".join(bad[:3]))
