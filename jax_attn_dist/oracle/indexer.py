"""indexer_kl (SPEC §5, with §6) and its gradients in float64 NumPy, and
SPEC §3.2's error measure."""

from __future__ import annotations

import numpy as np

from .validity import q_start_of, to_f64, valid_mask

#: SPEC §3.2: indexer_kl against this oracle, max |out - ref| <= tol * max(1, max |ref|).
INDEXER_TOLERANCE = 2e-4


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


def _indexer_prepare(index_q, index_k, weights, indices, target, q_start_index, packing=None):
    iq = to_f64(index_q)
    ik = to_f64(index_k)
    w = to_f64(weights)
    idx = np.asarray(indices).astype(np.int64)
    tg = np.asarray(target).astype(np.float64)
    batched = iq.ndim == 4
    if not batched:
        iq, ik, w, idx, tg = iq[None], ik[None], w[None], idx[None], tg[None]
    return batched, iq, ik, w, idx, tg, q_start_of(q_start_index, iq.shape[0], packing or {})


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
