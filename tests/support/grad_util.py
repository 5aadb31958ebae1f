"""Helpers shared by the gradient tests (attn_dist/test_grad.py and the
other CPU gradient tests, attn_dist/test_gpu_transforms.py with the kernel);
not a test module."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn_dist import oracle
from jax_attn_dist.oracle import to_f64

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST

#: Unit roundoff of float32, bfloat16 and float16 (half an ulp of 1).
UNIT_ROUNDOFF = {np.dtype(np.float32): 2.0 ** -24, np.dtype(jnp.bfloat16): 2.0 ** -8,
                 np.dtype(np.float16): 2.0 ** -11}


def plain_attn_dist(q, k, indices, lse, *, sm_scale, causal=True, q_start_index=0, k_stride=1, lse_base="2",
                    precision=HIGHEST):
    """SPEC §2 in float32, written out: gather, einsum, exp, mask, group sum.
    Materialises everything; differentiable by jax.grad (double-where masking).
    ``precision``: the q.k einsum's (a control may ask for TF32)."""
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
    z = sm_scale * jnp.einsum("bskhd,bsktd->bskht", qf, kg, precision=precision)
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


def _attn_dist_terms(q, k, indices, lse, *, sm_scale, causal, q_start_index, k_stride, lse_base):
    """float64 canonical pieces of SPEC §2 for the bounds below: (q [B,S,HK,Hg,D],
    gathered keys [B,S,HK,T,D], valid [B,S,HK,T], keep [B,S,HK,Hg,T], p, rel(p),
    batched). rel(p) bounds the relative error of any float32 evaluation of
    p = exp(z - lse_e), z = sm_scale sum_d q_d k_d::

        rel(p) <= u (D |z|_abs + |z| + |lse_e| + |z - lse_e| + 4)

    (u = 2^-24, |z|_abs = sm_scale sum_d |q_d k_d|: a D-term float32 dot
    product is off by at most D u |z|_abs; the scaling, the base conversion
    and the subtraction by u times their results; an absolute error e of the
    exponent is a relative error e of p; 4 u for exp and two products)."""
    q64, k64 = to_f64(q), to_f64(k)
    idx = np.asarray(indices).astype(np.int64)
    batched = q64.ndim == 4
    if not batched:
        q64, k64, idx = q64[None], k64[None], idx[None]
    lse64 = np.asarray(lse, np.float64).reshape(q64.shape[:3])
    B, S, H, D = q64.shape
    N, HK = k64.shape[1], k64.shape[2]
    Hg = H // HK
    valid = oracle.valid_mask(idx, N, causal=causal, q_start_index=q_start_index, k_stride=k_stride)  # [B,S,HK,T]
    ic = np.clip(idx, 0, max(N - 1, 0))
    kg = k64[np.arange(B)[:, None, None, None], ic, np.arange(HK)[None, None, :, None]]  # [B,S,HK,T,D]
    qf = q64.reshape(B, S, HK, Hg, D)
    z = sm_scale * np.einsum("bskhd,bsktd->bskht", qf, kg)
    z_abs = sm_scale * np.einsum("bskhd,bsktd->bskht", np.abs(qf), np.abs(kg))
    lse_e = (lse64 * math.log(2.0) if lse_base == "2" else lse64).reshape(B, S, HK, Hg)
    finite = np.isfinite(lse_e)
    keep = valid[:, :, :, None, :] & finite[..., None]
    lse_safe = np.where(finite, lse_e, 0.0)[..., None]
    arg = np.where(keep, z - lse_safe, 0.0)
    p = np.where(keep, np.exp(arg), 0.0)
    rel_p = UNIT_ROUNDOFF[np.dtype(np.float32)] * (D * z_abs + np.abs(z) + np.abs(lse_safe) + np.abs(arg) + 4)
    return qf, kg, idx, valid, keep, p, rel_p, batched


def attn_dist_out_f64(q, k, indices, lse, *, sm_scale, causal=True, q_start_index=0, k_stride=1, lse_base="2"):
    """``(out, rel)``: attn_dist in float64 [B?, G, S, T] and, per element, a
    bound on the relative error of a float32 evaluation (a sum of at most 64
    non-negative p, each within rel(p): at most max rel(p) + 65 u)."""
    qf, kg, idx, valid, keep, p, rel_p, batched = _attn_dist_terms(
        q, k, indices, lse, sm_scale=sm_scale, causal=causal, q_start_index=q_start_index, k_stride=k_stride,
        lse_base=lse_base)
    B, S, HK, Hg, T = p.shape
    H = HK * Hg
    G = -(-H // 64)
    pad = ((0, 0), (0, 0), (0, G * 64 - H), (0, 0))
    p_h = np.pad(p.reshape(B, S, H, T), pad).reshape(B, S, G, 64, T)
    rel_h = np.pad(np.where(keep, rel_p, 0.0).reshape(B, S, H, T), pad).reshape(B, S, G, 64, T)
    out = p_h.sum(axis=3).transpose(0, 2, 1, 3)
    rel = (rel_h.max(axis=3) + 65 * UNIT_ROUNDOFF[np.dtype(np.float32)]).transpose(0, 2, 1, 3)
    return (out, rel) if batched else (out[0], rel[0])


def attn_dist_grads_f64(q, k, indices, lse, cot, *, sm_scale, causal=True, q_start_index=0, k_stride=1,
                        lse_base="2", cot_rel_err=0.0):
    """``(grads, bounds)``: the float64 gradients ``(dq, dk, dlse)`` of
    ``sum(cot * attn_dist(q, k, indices, lse, ...))`` per SPEC §2.6 (inputs
    taken exactly), and for each of their elements a bound on the error of
    any float32 evaluation of the same sums (the jnp backward, or jax.grad of
    plain_attn_dist): the classic a-priori bound, term by term. Each term
    (dz k for dq, dz q for dk, G p for dlse; dz = G p sm_scale) is within
    rel(p) (see _attn_dist_terms) plus ``cot_rel_err`` (the relative error
    of a cotangent that was itself computed in float32, e.g. 2 out for the
    loss sum(out ** 2)) of its value, and a float32 sum of n terms is off by
    at most (n + 1) u times the sum of their absolute values; n is T for dq
    and dlse, the slots and heads hitting the key for dk. So::

        |err| <= sum over terms |term| (rel(p) + cot_rel_err + (n + 2) u)

    Rows of no valid slot, heads of non-finite lse: exactly 0 (bound 0)."""
    qf, kg, idx, valid, keep, p, rel_p, batched = _attn_dist_terms(
        q, k, indices, lse, sm_scale=sm_scale, causal=causal, q_start_index=q_start_index, k_stride=k_stride,
        lse_base=lse_base)
    g = np.asarray(cot, np.float64)
    g_rel = np.broadcast_to(np.asarray(cot_rel_err, np.float64), g.shape)
    if not batched:
        g, g_rel = g[None], g_rel[None]
    B, S, HK, Hg, T = p.shape
    H, D, N = HK * Hg, qf.shape[-1], int(np.asarray(k).shape[-3])
    u = UNIT_ROUNDOFF[np.dtype(np.float32)]
    heads = np.arange(H) // 64
    g_heads = g.transpose(0, 2, 1, 3)[:, :, heads, :].reshape(B, S, HK, Hg, T)  # cotangent of each head's p
    rel = rel_p + g_rel.transpose(0, 2, 1, 3)[:, :, heads, :].reshape(B, S, HK, Hg, T)
    dz = np.where(keep, g_heads * p * sm_scale, 0.0)
    c = math.log(2.0) if lse_base == "2" else 1.0

    dq = np.einsum("bskht,bsktd->bskhd", dz, kg).reshape(B, S, H, D)
    dq_err = np.einsum("bskht,bsktd->bskhd", np.abs(dz) * (rel + (T + 2) * u), np.abs(kg)).reshape(B, S, H, D)
    dlse = (-c * np.where(keep, g_heads * p, 0.0).sum(-1)).reshape(B, S, H)
    dlse_err = (c * (np.abs(g_heads) * p * (rel + (T + 2) * u)).sum(-1)).reshape(B, S, H)

    dk = np.zeros((B, N, HK, D))
    dk_abs_rel = np.zeros((B, N, HK, D))  # sum |term| rel
    dk_abs = np.zeros((B, N, HK, D))      # sum |term|
    hits = np.zeros((B, N, HK))           # terms per key
    b_, s_, kh_, t_ = np.nonzero(valid)
    keys = idx[b_, s_, kh_, t_]
    dz_n, q_n = dz[b_, s_, kh_, :, t_], qf[b_, s_, kh_]  # [n, Hg], [n, Hg, D]
    np.add.at(dk, (b_, keys, kh_), np.einsum("nh,nhd->nd", dz_n, q_n))
    np.add.at(dk_abs, (b_, keys, kh_), np.einsum("nh,nhd->nd", np.abs(dz_n), np.abs(q_n)))
    np.add.at(dk_abs_rel, (b_, keys, kh_),
              np.einsum("nh,nhd->nd", np.abs(dz_n) * rel[b_, s_, kh_, :, t_], np.abs(q_n)))
    np.add.at(hits, (b_, keys, kh_), Hg)
    dk_err = dk_abs_rel + (hits[..., None] + 2) * u * dk_abs

    grads, bounds = (dq, dk, dlse), (dq_err, dk_err, dlse_err)
    if not batched:
        grads, bounds = tuple(x[0] for x in grads), tuple(x[0] for x in bounds)
    return grads, bounds


def assert_grad_within(got, want, bound, name):
    """|got - want| <= bound elementwise, everything finite, and a reference
    that is not all zero (a degenerate test)."""
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, name
    assert np.all(np.isfinite(got)), f"{name}: non-finite gradient"
    assert np.abs(want).max() > 0, f"{name}: reference gradient is all zero (degenerate test)"
    err = np.abs(got - want)
    bad = err > bound
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert not bad.any(), (f"{name}: {bad.sum()} of {bad.size} elements off; worst at {worst}: error "
                           f"{err[worst]:.3e} > bound {bound[worst]:.3e} (|ref| {abs(want[worst]):.3e})")


def rounded_bound(bound, want, dtype):
    """``bound`` for a float32 result rounded once more, to ``dtype`` (the
    gradients of bf16/f16 inputs come back in their dtype): plus half an
    ulp of ``dtype`` of the result."""
    if np.dtype(dtype) == np.dtype(np.float32):
        return bound
    return bound + UNIT_ROUNDOFF[np.dtype(dtype)] * (np.abs(want) + bound)


def assert_grads_within_float32_bounds(ours, plain, q, k, idx, lse, kw, cot, cot_rel_err=0.0, label=""):
    """Both our gradients and plain jax.grad's are float32 evaluations of the
    same sums: each within attn_dist_grads_f64's rounding bound of the
    float64 gradients, so within twice that of each other; ours (dq, dk)
    then rounded once to the inputs' dtype. ``cot``: the output cotangent
    (float64 when it was computed in float32 too, within ``cot_rel_err``)."""
    want, bounds = attn_dist_grads_f64(q, k, idx, lse, cot, cot_rel_err=cot_rel_err, **kw)
    for name, a, b, w, bound in zip(("dq", "dk", "dlse"), ours, plain, want, bounds):
        rounded = rounded_bound(bound, w, a.dtype)
        assert_grad_within(a, w, rounded, f"{label}{name} vs float64")
        assert_grad_within(b, w, bound, f"{label}{name} (plain jax.grad) vs float64")
        assert_grad_within(a, b, rounded + bound, f"{label}{name} vs plain jax.grad")


def square_loss_cotangent(q, k, idx, lse, kw, w=1.0):
    """The cotangent 2 w out of sum(w * out ** 2) in float64, and the
    relative error of its float32 evaluation (out's, and two products)."""
    out, rel = attn_dist_out_f64(q, k, idx, lse, **kw)
    return 2.0 * np.asarray(w, np.float64) * out, rel + 2 * UNIT_ROUNDOFF[np.dtype(np.float32)]
