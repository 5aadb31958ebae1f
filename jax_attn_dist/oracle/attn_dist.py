"""attn_dist (SPEC §2, with §6) in float64 NumPy, and SPEC §3.1's error
measures."""

from __future__ import annotations

import math

import numpy as np

from .validity import prepare, to_f64, valid_mask

HEADS_PER_GROUP = 64


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
    batched, q, k, idx, q_start = prepare(q, k, indices, q_start_index, packing)
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
    batched, q, k, idx, q_start = prepare(q, k, indices, q_start_index, packing)
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


def assert_within_spec(out, ref, tol=ATTN_DIST_TOLERANCE):
    """SPEC §3: ||out-ref||/||ref|| <= tol and max|out-ref| <= tol * max|ref|."""
    assert np.all(np.isfinite(np.asarray(out))), "output has non-finite values"
    rel, mx = spec_errors(out, ref)
    assert rel <= tol and mx <= tol, f"rel Frobenius error {rel:.3e}, max-abs error / max|ref| {mx:.3e} (tol {tol:g})"
