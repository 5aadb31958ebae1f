"""An independent float64 NumPy evaluation of SPEC §2, §5 and §6 (no jax).

Written from docs/SPEC.md alone, sharing no code with the jnp paths: the
demo checks its result against it on every machine, the CPU tests check the
jnp paths and the GPU tests the CUDA kernels. Inputs are taken exactly:
bf16/f16/f32 values convert to float64 without rounding (through float32);
integer arithmetic is int64 with Python's floor division. Meant for test-sized
problems (it materialises [S, H, T] arrays per batch element).
"""

from __future__ import annotations

import math

import numpy as np

HEADS_PER_GROUP = 64


def to_f64(x) -> np.ndarray:
    """Exact float64 copy of a bf16/f16/f32 array (jax or numpy)."""
    return np.asarray(x).astype(np.float32).astype(np.float64)


def _q_start(q_start_index, B, packing):
    """q_start_index as int64: per batch element [B], or as given (an int or
    a per-sequence array) with SPEC §6's cu_seqlens."""
    if packing.get("cu_seqlens_q") is not None:
        return q_start_index
    return np.broadcast_to(np.asarray(q_start_index).astype(np.int64), (B,))


def _prepare(q, k, indices, q_start_index, packing=None):
    q, k = to_f64(q), np.asarray(k)  # k stays in its dtype: only gathered rows are widened
    idx = np.asarray(indices).astype(np.int64)
    batched = q.ndim == 4
    if not batched:
        q, k, idx = q[None], k[None], idx[None]
    B = q.shape[0]
    return batched, q, k, idx, _q_start(q_start_index, B, packing or {})


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


def _logits(q, k, idx, valid, sm_scale, b, s0, s1):
    """z [s, HK, Hg, T] float64 for batch b, rows s0..s1-1 (0 where invalid)."""
    N, HK, D = k.shape[1:]
    H = q.shape[2]
    ic = np.clip(idx[b, s0:s1], 0, max(N - 1, 0))  # [s, HK, T]
    kh = np.arange(HK)[None, :, None]
    kg = to_f64(k[b][ic, kh])  # [s, HK, T, D]
    qb = q[b, s0:s1].reshape(s1 - s0, HK, H // HK, D)
    z = sm_scale * np.matmul(qb, kg.swapaxes(-1, -2))  # [s, HK, Hg, T]
    return np.where(valid[b, s0:s1][:, :, None, :], z, 0.0)


def attn_dist_oracle(
    q, k, indices, lse, *, sm_scale, causal=True, q_start_index=0, k_stride=1, lse_base="2",
    rows_per_block=16, **packing,
):
    """float64 [B?, G, S, T] per SPEC §2 (heads grouped 64 at a time);
    ``packing``: SPEC §6's keywords."""
    batched, q, k, idx, q_start = _prepare(q, k, indices, q_start_index, packing)
    lse = np.asarray(lse).astype(np.float64)
    if not batched:
        lse = lse[None]
    B, S, H, D = q.shape
    N, HK = k.shape[1:3]
    T = idx.shape[-1]
    G = -(-H // HEADS_PER_GROUP)
    out = np.zeros((B, G, S, T), np.float64)
    if N > 0 and S > 0 and T > 0:
        valid = valid_mask(idx, N, causal=causal, q_start_index=q_start, k_stride=k_stride, **packing)
        lse_e = lse * math.log(2.0) if lse_base == "2" else lse
        finite = np.isfinite(lse_e)
        lse_safe = np.where(finite, lse_e, 0.0)
        for b in range(B):
            for s0 in range(0, S, rows_per_block):
                s1 = min(S, s0 + rows_per_block)
                z = _logits(q, k, idx, valid, sm_scale, b, s0, s1)  # [s, HK, Hg, T]
                z = z.reshape(s1 - s0, H, T)
                with np.errstate(over="ignore", under="ignore"):
                    p = np.exp(z - lse_safe[b, s0:s1, :, None])
                hk_of_h = np.arange(H) // (H // HK)
                keep = valid[b, s0:s1][:, hk_of_h, :] & finite[b, s0:s1, :, None]
                p = np.where(keep, p, 0.0)
                for g in range(G):
                    out[b, g, s0:s1] = p[:, g * HEADS_PER_GROUP : (g + 1) * HEADS_PER_GROUP].sum(axis=1)
    return out if batched else out[0]


def exact_lse(
    q, k, indices, *, sm_scale, causal=True, q_start_index=0, k_stride=1, lse_base="2",
    empty_value=np.inf, **packing,
):
    """float64 [B?, S, H]: log-sum-exp (base ``lse_base``) of z over each
    head's valid slots; ``empty_value`` where there are none."""
    batched, q, k, idx, q_start = _prepare(q, k, indices, q_start_index, packing)
    B, S, H, D = q.shape
    N, HK = k.shape[1:3]
    T = idx.shape[-1]
    out = np.full((B, S, H), empty_value, np.float64)
    if N > 0 and S > 0 and T > 0:
        valid = valid_mask(idx, N, causal=causal, q_start_index=q_start, k_stride=k_stride, **packing)
        for b in range(B):
            z = _logits(q, k, idx, valid, sm_scale, b, 0, S)  # [S, HK, Hg, T]
            v = np.broadcast_to(valid[b][:, :, None, :], z.shape)
            zm = np.where(v, z, -np.inf)
            m = zm.max(axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            with np.errstate(divide="ignore"):
                lse_e = np.log(np.exp(zm - m).sum(axis=-1)) + m[..., 0]
            any_v = v.any(axis=-1)
            val = lse_e if lse_base == "e" else lse_e / math.log(2.0)
            out[b] = np.where(any_v, val, empty_value).reshape(S, H)
    return out if batched else out[0]


def spec_errors(out, ref):
    """(||out-ref||/||ref||, max|out-ref| / max|ref|) in float64."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    d = out - ref
    nref = np.linalg.norm(ref)
    mref = np.abs(ref).max() if ref.size else 0.0
    rel = np.linalg.norm(d) / nref if nref > 0 else np.linalg.norm(d)
    mx = (np.abs(d).max() / mref if mref > 0 else np.abs(d).max()) if d.size else 0.0
    return float(rel), float(mx)


#: SPEC §3: attn_dist against this oracle.
ATTN_DIST_TOLERANCE = 1e-4
#: SPEC §3.2: indexer_kl against this oracle, max |out - ref| <= tol * max(1, max |ref|).
INDEXER_TOLERANCE = 2e-4


def assert_within_spec(out, ref, tol=ATTN_DIST_TOLERANCE):
    """SPEC §3: ||out-ref||/||ref|| <= tol and max|out-ref| <= tol * max|ref|."""
    assert np.all(np.isfinite(np.asarray(out))), "output has non-finite values"
    rel, mx = spec_errors(out, ref)
    assert rel <= tol and mx <= tol, f"rel Frobenius error {rel:.3e}, max-abs error / max|ref| {mx:.3e} (tol {tol:g})"


def indexer_error(out, ref) -> float:
    """max |out - ref| / max(1, max |ref|) (SPEC §3.2)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.size == 0:
        return 0.0
    return float(np.abs(out - ref).max() / max(1.0, np.abs(ref).max()))


def assert_indexer_close(out, ref, tol=INDEXER_TOLERANCE):
    """SPEC §3.2: max |out - ref| <= tol * max(1, max |ref|), everything finite."""
    assert np.all(np.isfinite(np.asarray(out))), "output has non-finite values"
    err = indexer_error(out, ref)
    assert err <= tol, f"max-abs error / max(1, max|ref|) = {err:.3e} (tol {tol:g})"


# ----------------------------------------------------------------------------
# indexer_kl (SPEC §5)
# ----------------------------------------------------------------------------


def _indexer_prepare(index_q, index_k, weights, indices, target, q_start_index, packing=None):
    iq = to_f64(index_q)
    ik = to_f64(index_k)
    w = to_f64(weights)
    idx = np.asarray(indices).astype(np.int64)
    tg = np.asarray(target).astype(np.float64)
    batched = iq.ndim == 4
    if not batched:
        iq, ik, w, idx, tg = iq[None], ik[None], w[None], idx[None], tg[None]
    return batched, iq, ik, w, idx, tg, _q_start(q_start_index, iq.shape[0], packing or {})


def _indexer_batch(iq, ik, w, idx, tg, valid, scale):
    """One batch element: z [S, HI, T], logits [S, T], valid [S, T], t [S, T]."""
    N = ik.shape[0]
    ic = np.clip(idx[:, 0, :], 0, max(N - 1, 0))               # [S, T]
    kg = ik[ic] if N > 0 else np.zeros(ic.shape + (ik.shape[-1],))  # [S, T, DI]
    z = np.einsum("shd,std->sht", iq, kg)
    logits = scale * np.einsum("sh,sht->st", w, np.maximum(z, 0.0))
    t = np.where(valid & (tg > 0), tg, 0.0)
    return z, kg, logits, t


def _log_softmax_valid(logits, valid):
    x = np.where(valid, logits, -np.inf)
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m
    return np.where(valid, logits - lse, -np.inf)


def indexer_kl_oracle(index_q, index_k, weights, indices, target, *, scale=1.0, causal=True, q_start_index=0,
                      k_stride=1, **packing):
    """float64 [B?, S]: kl(s) = sum_j t (log t - log_p) per SPEC §5."""
    batched, iq, ik, w, idx, tg, q_start = _indexer_prepare(index_q, index_k, weights, indices, target,
                                                            q_start_index, packing)
    B, S = iq.shape[:2]
    N = ik.shape[1]
    out = np.zeros((B, S))
    valid = valid_mask(idx, N, causal=causal, q_start_index=q_start, k_stride=k_stride, **packing)[:, :, 0, :]
    for b in range(B):
        if S == 0 or idx.shape[-1] == 0:
            continue
        _, _, logits, t = _indexer_batch(iq[b], ik[b], w[b], idx[b], tg[b], valid[b], scale)
        log_p = _log_softmax_valid(logits, valid[b])
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(t > 0, t * (np.log(np.where(t > 0, t, 1.0)) - log_p), 0.0)
        out[b] = terms.sum(axis=-1)
    return out if batched else out[0]


def indexer_grads_oracle(index_q, index_k, weights, indices, target, g, *, scale=1.0, causal=True,
                         q_start_index=0, k_stride=1, magnitudes=False, **packing):
    """float64 gradients (d index_q, d index_k, d weights) of sum_s g(s) kl(s)
    per SPEC §5.3's formulas (g [B?, S]).

    ``magnitudes=True`` also returns, per gradient element, the sum of the
    absolute values of its terms (|dz| |k|, |dz| |q|, scale |dl| relu(z)):
    the scale of the rounding error a computation of those sums can make
    (SPEC §3.2's bound for the backward kernel); and the sum of the terms
    whose relu mask [z > 0] is ambiguous, |z| <= 2^-14 sum_d |q_d k_d|: a
    float32 z may fall on either side of 0 there, switching that whole term
    of d index_q and d index_k on or off. Returns (grads, mags, ambiguous)."""
    batched, iq, ik, w, idx, tg, q_start = _indexer_prepare(index_q, index_k, weights, indices, target,
                                                            q_start_index, packing)
    gg = np.asarray(g).astype(np.float64)
    if not batched:
        gg = gg[None]
    B, S = iq.shape[:2]
    N = ik.shape[1]
    d_iq, d_ik, d_w = np.zeros_like(iq), np.zeros_like(ik), np.zeros_like(w)
    m_iq, m_ik, m_w = np.zeros_like(iq), np.zeros_like(ik), np.zeros_like(w)
    a_iq, a_ik = np.zeros_like(iq), np.zeros_like(ik)
    valid = valid_mask(idx, N, causal=causal, q_start_index=q_start, k_stride=k_stride, **packing)[:, :, 0, :]
    for b in range(B):
        if S == 0 or idx.shape[-1] == 0:
            continue
        v = valid[b]
        z, kg, logits, t = _indexer_batch(iq[b], ik[b], w[b], idx[b], tg[b], v, scale)
        p = np.where(v, np.exp(_log_softmax_valid(logits, v)), 0.0)
        tau = t.sum(axis=-1, keepdims=True)
        dl = np.where(v & (tau > 0), gg[b][:, None] * (p * tau - t), 0.0)           # [S, T]
        d_w[b] = scale * np.einsum("st,sht->sh", dl, np.maximum(z, 0.0))
        dz = np.where(z > 0, dl[:, None, :] * scale * w[b][:, :, None], 0.0)       # [S, HI, T]
        d_iq[b] = np.einsum("sht,std->shd", dz, kg)
        contrib = np.einsum("sht,shd->std", dz, iq[b])                               # [S, T, DI]
        keys = idx[b][:, 0, :]
        np.add.at(d_ik[b], keys[v], contrib[v])
        if magnitudes:
            m_w[b] = scale * np.einsum("st,sht->sh", np.abs(dl), np.maximum(z, 0.0))
            m_iq[b] = np.einsum("sht,std->shd", np.abs(dz), np.abs(kg))
            np.add.at(m_ik[b], keys[v], np.einsum("sht,shd->std", np.abs(dz), np.abs(iq[b]))[v])
            z_mag = np.einsum("shd,std->sht", np.abs(iq[b]), np.abs(kg))
            ambiguous = np.abs(z) <= 2.0 ** -14 * z_mag
            dz_amb = np.where(ambiguous, np.abs(dl)[:, None, :] * scale * np.abs(w[b])[:, :, None], 0.0)
            a_iq[b] = np.einsum("sht,std->shd", dz_amb, np.abs(kg))
            np.add.at(a_ik[b], keys[v], np.einsum("sht,shd->std", dz_amb, np.abs(iq[b]))[v])
    if not batched:
        d_iq, d_ik, d_w = d_iq[0], d_ik[0], d_w[0]
        m_iq, m_ik, m_w = m_iq[0], m_ik[0], m_w[0]
        a_iq, a_ik = a_iq[0], a_ik[0]
    if magnitudes:
        return (d_iq, d_ik, d_w), (m_iq, m_ik, m_w), (a_iq, a_ik, np.zeros_like(m_w))
    return d_iq, d_ik, d_w


def indexer_lse_oracle(index_q, index_k, weights, indices, *, scale=1.0, causal=True, q_start_index=0, k_stride=1,
                       **packing):
    """float64 [B?, S]: the log-sum-exp of each row's valid logits (-inf
    for a row with none): the residual indexer_kl's forward saves."""
    T = np.asarray(indices).shape[-1]
    target = np.zeros(np.asarray(indices).shape[:-2] + (T,))
    batched, iq, ik, w, idx, tg, q_start = _indexer_prepare(index_q, index_k, weights, indices, target,
                                                            q_start_index, packing)
    B, S = iq.shape[:2]
    N = ik.shape[1]
    out = np.full((B, S), -np.inf)
    valid = valid_mask(idx, N, causal=causal, q_start_index=q_start, k_stride=k_stride, **packing)[:, :, 0, :]
    for b in range(B):
        if S == 0 or T == 0:
            continue
        _, _, logits, _ = _indexer_batch(iq[b], ik[b], w[b], idx[b], tg[b], valid[b], scale)
        x = np.where(valid[b], logits, -np.inf)
        m = x.max(axis=-1)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            out[b] = np.log(np.exp(x - m_safe[:, None]).sum(axis=-1)) + m_safe
    return out if batched else out[0]
