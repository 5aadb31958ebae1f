"""sparse_mla's jnp backward pass: the executable form of SPEC §8.3's
gradient formulas.

It recomputes what it needs from the inputs and the forward's lse (no
``[B, S, H, T]`` residual), chunked over the B*S query rows like the
reference (temporaries bounded independently of S): per chunk it gathers
the selected kv rows once, recomputes the scores exactly as the forward does
and forms the gradients in float32 (``Precision.HIGHEST``: no TF32 on a
GPU). Row gradients (dq) are written per chunk; the kv gradient accumulates
in float32 over the chunks, in chunk order (with ``deterministic``, by a
sort and a segmented scan, bitwise reproducible on a GPU too). Results come
back in the input dtypes.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from ..._core.chunks import HIGHEST, LOG2E, chunk_scores, row_loop, rows_of, sorted_segment_scatter_add
from . import contract
from .reference import lse_natural, sparse_mla_chunk_rows


def sparse_mla_bwd_canonical(
    q, kv, indices, q_start, row_ranges, lse, dout, dlse, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, d_v: int, deterministic: bool, chunk: Optional[int] = None, dkv_dtype=None, **unused_params,
):
    """Gradients ``(dq, dkv)`` of ``sum(dout * out) + sum(dlse * lse)`` on
    canonical operands (as ``reference_canonical``), with ``lse`` [B,S,H]
    the forward's lse (base ``lse_base``) and the cotangents ``dout``
    [B,S,H,d_v], ``dlse`` [B,S,H]. With ``P = exp(score - lse_e)`` on the
    valid slots (0 elsewhere and where lse is not finite), ``V = kv[i][:d_v]``
    and ``dlse_e = dlse`` (base e) or ``dlse * log2(e)`` (base 2)::

        dP = dout . V;   delta = sum_j P dP   (= rowsum(dout * out))
        dS = P (dP - delta + dlse_e)
        dq[s, h]   = sm_scale sum_j dS kv[i]
        dkv[i]    += sm_scale dS q[s, h];   dkv[i][:d_v] += P dout[s, h]

    Invalid slots and heads of non-finite lse contribute exactly 0, whatever
    the cotangents hold. ``dq`` has q's dtype, ``dkv`` kv's (or
    ``dkv_dtype``: the backward primitive keeps it float32 until the shards'
    partial sums are added)."""
    problem = contract.check_canonical(q, kv, indices, q_start, row_ranges)
    B, S, H, D, N, HK, T = problem.B, problem.S, problem.H, problem.D, problem.N, problem.HK, problem.T
    if problem.is_empty:
        return jnp.zeros_like(q), jnp.zeros(kv.shape, dkv_dtype or kv.dtype)
    R = B * S
    Hg = H // HK
    C = min(int(chunk), R) if chunk else sparse_mla_chunk_rows(problem, d_v, backward=True)
    dlse_scale = jnp.float32(1.0 if lse_base == "e" else LOG2E)
    kh = jnp.arange(HK, dtype=jnp.int32)

    def chunk_grads(start, first_new, dkv):
        scores = chunk_scores(q, kv, indices, q_start, row_ranges, start, C, problem, causal=causal,
                              k_stride=k_stride)
        lse_e = lse_natural(rows_of(lse, start, C).reshape(C, HK, Hg), lse_base)
        finite = jnp.isfinite(lse_e)
        keep = scores.valid[:, :, None, :] & finite[..., None]                       # [C, HK, Hg, T]
        arg = scores.acc * jnp.float32(sm_scale) - jnp.where(finite, lse_e, 0.0)[..., None]
        p = jnp.where(keep, jnp.exp(jnp.where(keep, arg, 0.0)), jnp.float32(0.0))

        do = rows_of(dout, start, C).astype(jnp.float32).reshape(C, HK, Hg, d_v)
        dl = rows_of(dlse, start, C).astype(jnp.float32).reshape(C, HK, Hg) * dlse_scale
        kg = scores.kg.astype(jnp.float32)                                           # [C, HK, T, D]
        dp = jnp.einsum("rkhd,rktd->rkht", do, kg[..., :d_v], precision=HIGHEST)
        delta = jnp.sum(p * dp, axis=-1)
        ds = jnp.where(keep, p * (dp - delta[..., None] + dl[..., None]), jnp.float32(0.0))

        dq_rows = jnp.float32(sm_scale) * jnp.einsum("rkht,rktd->rkhd", ds, kg, precision=HIGHEST)

        fresh = (scores.rows >= first_new)[:, None, None, None]
        ds_new = jnp.where(fresh, ds, jnp.float32(0.0))
        p_new = jnp.where(fresh, p, jnp.float32(0.0))
        dk_rows = jnp.float32(sm_scale) * jnp.einsum("rkht,rkhd->rktd", ds_new, scores.q_rows.astype(jnp.float32),
                                                     precision=HIGHEST)
        dv_rows = jnp.einsum("rkht,rkhd->rktd", p_new, do, precision=HIGHEST)       # [C, HK, T, d_v]
        dk_rows = dk_rows + jnp.pad(dv_rows, ((0, 0), (0, 0), (0, 0), (0, D - d_v)))
        key = (scores.b_rows[:, None, None] * N + scores.idx_c) * HK + kh[None, :, None]
        key = jnp.where(scores.valid, key, B * N * HK).reshape(C * HK * T)          # invalid: dropped
        dk_rows = dk_rows.reshape(C * HK * T, D)
        if deterministic:
            dkv = sorted_segment_scatter_add(dkv, key, dk_rows, num_keys=B * N * HK)
        else:
            dkv = dkv.at[key].add(dk_rows, mode="drop")
        return (dq_rows.reshape(C, H, D),), dkv

    dkv0 = jnp.zeros((B * N * HK, D), jnp.float32)
    (dq,), dkv = row_loop(chunk_grads, R, C, [((H, D), jnp.float32)], dkv0)
    return dq.reshape(B, S, H, D).astype(q.dtype), dkv.reshape(B, N, HK, D).astype(dkv_dtype or kv.dtype)
