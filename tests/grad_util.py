"""Helpers shared by the gradient tests (tests/test_grad.py on the CPU,
tests/test_gpu_transforms.py with the kernel); not a test module."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def plain_attn_dist(q, k, indices, lse, *, sm_scale, causal=True, q_start_index=0, k_stride=1, lse_base="2"):
    """SPEC §2 in float32, written out: gather, einsum, exp, mask, group sum.
    Materialises everything; differentiable by jax.grad (double-where masking)."""
    batched = q.ndim == 4
    if not batched:
        q, k, indices, lse = (x[None] for x in (q, k, indices, lse))
    B, S, H, D = q.shape
    N, HK = k.shape[1], k.shape[2]
    T = indices.shape[-1]
    Hg = H // HK
    qf = q.astype(F32).reshape(B, S, HK, Hg, D)
    kf = k.astype(F32)
    valid = (indices >= 0) & (indices < N)
    if causal:
        qs = jnp.broadcast_to(jnp.asarray(q_start_index, jnp.int32), (B,))
        limit = jnp.floor_divide(qs[:, None] + jnp.arange(S)[None, :] + 1 - k_stride, k_stride)
        valid = valid & (indices <= limit[:, :, None, None])
    ic = jnp.clip(indices, 0, N - 1)
    b_ix = jnp.arange(B)[:, None, None, None]
    kh_ix = jnp.arange(HK)[None, None, :, None]
    kg = kf[b_ix, ic, kh_ix]  # [B, S, HK, T, D]
    z = sm_scale * jnp.einsum("bskhd,bsktd->bskht", qf, kg, precision=HIGHEST)
    lse_e = lse * math.log(2.0) if lse_base == "2" else lse
    lse_e = lse_e.reshape(B, S, HK, Hg)
    finite = jnp.isfinite(lse_e)
    keep = valid[:, :, :, None, :] & finite[..., None]
    arg = jnp.where(keep, z - jnp.where(finite, lse_e, 0.0)[..., None], 0.0)
    p = jnp.where(keep, jnp.exp(arg), 0.0).reshape(B, S, H, T)
    G = -(-H // 64)
    p = jnp.pad(p, ((0, 0), (0, 0), (0, G * 64 - H), (0, 0)))
    out = p.reshape(B, S, G, 64, T).sum(axis=3).transpose(0, 2, 1, 3)
    return out if batched else out[0]


def assert_grad_close(got, want, name, rtol, atol_frac=None):
    """|got - want| <= rtol |want| + atol_frac max|want| elementwise
    (atol_frac defaults to rtol / 1000), everything finite."""
    atol_frac = 1e-3 * rtol if atol_frac is None else atol_frac
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, name
    assert np.all(np.isfinite(got)), f"{name}: non-finite gradient"
    scale = np.abs(want).max()
    assert scale > 0, f"{name}: reference gradient is all zero (degenerate test)"
    err = np.abs(got - want)
    bad = err > rtol * np.abs(want) + atol_frac * scale
    assert not bad.any(), (
        f"{name}: {bad.sum()} of {bad.size} elements off; max err {err.max():.3e}, "
        f"max |ref| {scale:.3e}, worst at {np.unravel_index(np.argmax(err - rtol * np.abs(want)), err.shape)}"
    )


def plain_indexer_kl(index_q, index_k, weights, indices, target, *, scale=1.0, causal=True, q_start_index=0,
                     k_stride=1):
    """SPEC §5 in float32, written out: gather, einsum, relu, weighted sum,
    masked log_softmax, KL. Materialises everything; differentiable by
    jax.grad (double-where masking keeps NaN out of the gradients)."""
    batched = index_q.ndim == 4
    if not batched:
        index_q, index_k, weights, indices, target = (x[None] for x in (index_q, index_k, weights, indices, target))
    B, S, HI, DI = index_q.shape
    N = index_k.shape[1]
    idx = indices[:, :, 0, :]
    valid = (idx >= 0) & (idx < N)
    if causal:
        qs = jnp.broadcast_to(jnp.asarray(q_start_index, jnp.int32), (B,))
        limit = jnp.floor_divide(qs[:, None] + jnp.arange(S)[None, :] + 1 - k_stride, k_stride)
        valid = valid & (idx <= limit[:, :, None])
    kg = index_k.astype(F32)[jnp.arange(B)[:, None, None], jnp.clip(idx, 0, N - 1)]  # [B, S, T, DI]
    z = jnp.einsum("bshd,bstd->bsht", index_q.astype(F32), kg, precision=HIGHEST)
    logits = scale * jnp.einsum("bsh,bsht->bst", weights.astype(F32), jnp.maximum(z, 0.0), precision=HIGHEST)
    x = jnp.where(valid, logits, -1e30)
    log_p = x - jax.scipy.special.logsumexp(x, axis=-1, keepdims=True)
    t = jnp.where(valid & (target > 0), target, 0.0)
    pos = t > 0
    kl = jnp.sum(jnp.where(pos, t * (jnp.log(jnp.where(pos, t, 1.0)) - jnp.where(pos, log_p, 0.0)), 0.0), axis=-1)
    return kl if batched else kl[0]
