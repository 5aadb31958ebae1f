"""sparse_mla (SPEC §8, with §6) in float64 NumPy: the output, the lse and
the analytic gradients of §8.3."""

from __future__ import annotations

import math

import numpy as np

from .validity import prepare, to_f64, valid_mask


def _rows(q, kv, idx, valid, sm_scale, b, s0, s1):
    """(z [s, HK, Hg, T] float64 with -inf on invalid slots, gathered kv
    rows [s, HK, T, D] float64, q rows [s, HK, Hg, D]) for batch b, rows
    s0..s1-1."""
    N, HK, D = kv.shape[1:]
    H = q.shape[2]
    ic = np.clip(idx[b, s0:s1], 0, max(N - 1, 0))  # [s, HK, T]
    kg = to_f64(kv[b][ic, np.arange(HK)[None, :, None]])  # [s, HK, T, D]
    qb = q[b, s0:s1].reshape(s1 - s0, HK, H // HK, D)
    z = sm_scale * np.matmul(qb, kg.swapaxes(-1, -2))  # [s, HK, Hg, T]
    return np.where(valid[b, s0:s1][:, :, None, :], z, -np.inf), kg, qb


def _softmax(z):
    """(P [.., T], lse_e [..]) of z over the last axis, -inf entries left
    out; P = 0 and lse_e = -inf where every entry is -inf."""
    m = z.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    l = e.sum(axis=-1)
    has = l > 0
    p = e / np.where(has, l, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(has, np.log(np.where(has, l, 1.0)) + m[..., 0], -np.inf)
    return p, lse


def _setup(q, kv, indices, q_start_index, causal, k_stride, packing):
    batched, q, kv, idx, q_start = prepare(q, kv, indices, q_start_index, packing)
    B, S, H, D = q.shape
    N, HK = kv.shape[1:3]
    T = idx.shape[-1]
    valid = None
    if N > 0 and S > 0 and T > 0:
        valid = valid_mask(idx, N, causal=causal, q_start_index=q_start, k_stride=k_stride, **packing)
    return batched, q, kv, idx, valid, (B, S, H, D, N, HK, T)


def sparse_mla_oracle(
    q, kv, indices, *, sm_scale, d_v=512, causal=True, q_start_index=0, k_stride=1, lse_base="2",
    rows_per_block=16, **packing,
):
    """``(out, lse)`` in float64 per SPEC §8: out [B?, S, H, d_v], lse
    [B?, S, H] in base ``lse_base`` (-inf, and out 0, for a head row with no
    valid slot); ``packing``: SPEC §6's keywords."""
    batched, q, kv, idx, valid, (B, S, H, D, N, HK, T) = _setup(q, kv, indices, q_start_index, causal, k_stride,
                                                               packing)
    out = np.zeros((B, S, H, d_v), np.float64)
    lse = np.full((B, S, H), -np.inf, np.float64)
    if valid is not None:
        for b in range(B):
            for s0 in range(0, S, rows_per_block):
                s1 = min(S, s0 + rows_per_block)
                z, kg, _ = _rows(q, kv, idx, valid, sm_scale, b, s0, s1)
                p, lse_e = _softmax(z)  # [s, HK, Hg, T], [s, HK, Hg]
                out[b, s0:s1] = np.matmul(p, kg[..., :d_v]).reshape(s1 - s0, H, d_v)
                lse[b, s0:s1] = lse_e.reshape(s1 - s0, H)
    if lse_base == "2":
        lse = lse / math.log(2.0)
    return (out, lse) if batched else (out[0], lse[0])


def sparse_mla_grads_oracle(
    q, kv, indices, dout, dlse, *, sm_scale, d_v=512, causal=True, q_start_index=0, k_stride=1, lse_base="2",
    **packing,
):
    """``(dq, dkv)`` in float64: the gradients of ``sum(dout * out) + sum(dlse
    * lse)`` per SPEC §8.3, from the exact P (not from a rounded lse). With
    ``dlse_e = dlse`` (base e) or ``dlse / ln 2`` (base 2)::

        dP = dout . V;  dS = P (dP - sum_j P dP + dlse_e)
        dq = sm_scale sum_j dS kv[i];  dkv[i] += sm_scale dS q;  dkv[i][:d_v] += P dout
    """
    batched, q, kv, idx, valid, (B, S, H, D, N, HK, T) = _setup(q, kv, indices, q_start_index, causal, k_stride,
                                                               packing)
    dout = np.asarray(dout, np.float64)
    dlse = np.asarray(dlse, np.float64)
    if not batched:
        dout, dlse = dout[None], dlse[None]
    dlse_e = dlse / math.log(2.0) if lse_base == "2" else dlse
    dq = np.zeros((B, S, H, D))
    dkv = np.zeros((B, N, HK, D))
    if valid is not None:
        Hg = H // HK
        for b in range(B):
            z, kg, qb = _rows(q, kv, idx, valid, sm_scale, b, 0, S)
            p, _ = _softmax(z)                                   # [S, HK, Hg, T]
            do = dout[b].reshape(S, HK, Hg, d_v)
            dp = np.matmul(do, kg[..., :d_v].swapaxes(-1, -2))   # [S, HK, Hg, T]
            delta = (p * dp).sum(-1, keepdims=True)
            ds = p * (dp - delta + dlse_e[b].reshape(S, HK, Hg)[..., None])
            dq[b] = (sm_scale * np.matmul(ds, kg)).reshape(S, H, D)
            s_, kh_, t_ = np.nonzero(valid[b])
            keys = idx[b, s_, kh_, t_]
            terms = sm_scale * np.einsum("nh,nhd->nd", ds[s_, kh_, :, t_], qb[s_, kh_])
            terms[:, :d_v] += np.einsum("nh,nhd->nd", p[s_, kh_, :, t_], do[s_, kh_])
            np.add.at(dkv[b], (keys, kh_), terms)
    return (dq, dkv) if batched else (dq[0], dkv[0])


#: SPEC §8.2: the CUDA kernel's bf16 ``out`` against this oracle (relative
#: Frobenius and max-abs errors) and its lse (absolute, in its base).
SPARSE_MLA_OUT_TOLERANCE = 1e-2
SPARSE_MLA_LSE_TOLERANCE = 1e-4
