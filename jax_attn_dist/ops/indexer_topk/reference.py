"""indexer_topk's jnp path: the executable form of SPEC §9, on any backend.

Per batch element (``lax.map``, one after another) and per chunk of query
rows (``_core.chunks.row_loop``), so that no ``[S, N]`` array exists beyond
a chunk's ``[C, N]`` (and its ``[C, HI, N]`` scores):

1. the logits in float32: ``z = index_q . index_k`` (bf16/f16 products
   accumulated in float32; float32 and float8 operands as float32 at
   ``Precision.HIGHEST``), times ``index_k_scale``, relu, the weighted head
   sum, times ``scale``;
2. each row's valid keys, one range ``[begin, end)`` (SPEC §2's causal rule,
   or SPEC §6's row ranges);
3. the selection (:func:`select_topk`): the ``topk`` largest logits among
   the valid keys, ties at the cut to the smaller key, in ascending key
   order, padded with -1.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..._core.chunks import HIGHEST, causal_parts, chunk_rows, row_loop, visible_keys
from . import contract


def topk_chunk_rows(problem: contract.Problem, topk: int) -> int:
    """Rows per chunk: the float32 scores ``[HI, N]`` and relu of one row,
    its logits and masks ``[N]`` and the selection's temporaries."""
    per_row = 2 * problem.HI * problem.N * 4 + 6 * problem.N * 4 + 4 * topk * 4
    return max(1, min(chunk_rows(problem, per_row_bytes=per_row), problem.S))


def select_topk(logits, valid, topk: int):
    """SPEC §9's selection on one chunk: ``logits`` [C, N] float32, ``valid``
    [C, N] bool -> int32 [C, topk]: the valid keys with the ``topk`` largest
    logits, ties at the cut broken towards the smaller key, in ascending key
    order, then -1 where the row has fewer than ``topk`` valid keys.

    The cut is the ``k = min(topk, N)``-th largest value (``lax.top_k``'s
    values do not depend on how it orders ties): every valid key above it is
    kept, and of the keys equal to it the smallest ones, as many as are
    missing. One integer ``top_k`` does both: keys above the cut get the
    codes ``2N - n`` (all above ``N``), keys at it ``N - n`` (the smaller
    key, the larger code), the others 0; the ``k`` largest codes are the
    selection, and a last ``top_k`` over them puts the keys in ascending
    order. -0.0 and +0.0 compare equal. A NaN logit of a valid key ranks
    below every number (it is still a valid key). Needs ``2N < 2**31``."""
    C, N = logits.shape
    k = min(topk, N)
    x = jnp.where(valid & ~jnp.isnan(logits), logits, -jnp.inf)
    cut = jax.lax.top_k(x, k)[0][:, k - 1:k]                                   # [C, 1]
    n = jnp.arange(N, dtype=jnp.int32)
    code = jnp.where(valid & (x > cut), 2 * N - n, jnp.where(valid & (x == cut), N - n, 0))
    code = jax.lax.top_k(code, k)[0]                                            # [C, k]
    keys = jnp.where(code > N, 2 * N - code, N - code)                         # the kept keys; N where none
    ordered = jax.lax.top_k(N - keys, k)[0]                                     # ascending keys, N last
    out = jnp.where(ordered > 0, N - ordered, -1)
    if k < topk:
        out = jnp.concatenate([out, jnp.full((C, topk - k), -1, jnp.int32)], axis=-1)
    return out


def row_key_ranges(s_rows, q0, ranges, *, N: int, causal: bool, k_stride: int):
    """``(begin, end)`` int32 [C]: row ``s``'s valid keys are ``begin <= n <
    end``. ``ranges``: the rows' SPEC §6 ranges [C, 3] (fields 0 and 1; the
    key begin clamped into [0, N], the end into [begin, N]), or None: then
    SPEC §2's rule, ``n < N`` and, when causal,
    ``n <= floor((q0 + s + 1 - k_stride) / k_stride)``, exact for every int32
    ``q0``."""
    if ranges is not None:
        begin = jnp.clip(ranges[:, 0], 0, N)
        return begin, jnp.clip(ranges[:, 1], begin, N)
    begin = jnp.zeros_like(s_rows)
    if not causal:
        return begin, jnp.full_like(s_rows, N)
    qq, qr = causal_parts(q0, k_stride)
    return begin, visible_keys(s_rows, qq, qr, N, k_stride=k_stride)


def chunk_logits(q_rows, w_rows, index_k, k_scale, *, scale: float, dtype):
    """SPEC §9's float32 logits [C, N] of one chunk's rows (``q_rows`` [C, HI,
    DI], ``w_rows`` [C, HI]) against one batch element's keys (``index_k``
    [N, DI], ``k_scale`` [N] f32)."""
    if dtype == jnp.dtype(jnp.float32) or dtype in contract.FP8_DTYPES:
        z = jnp.einsum("rhd,nd->rhn", q_rows.astype(jnp.float32), index_k.astype(jnp.float32),
                       precision=HIGHEST, preferred_element_type=jnp.float32)
    else:  # bf16 / f16: exact products, float32 sums
        z = jnp.einsum("rhd,nd->rhn", q_rows, index_k, preferred_element_type=jnp.float32)
    z = jnp.maximum(z * k_scale[None, None, :], 0.0)
    return jnp.float32(scale) * jnp.einsum("rh,rhn->rn", w_rows.astype(jnp.float32), z, precision=HIGHEST)


def indexer_topk_reference_canonical(
    index_q, index_k, weights, index_k_scale, q_start, row_ranges, *, topk: int, scale: float, causal: bool,
    k_stride: int, chunk: Optional[int] = None, **unused_params,
):
    """SPEC §9 on canonical operands: index_q [B,S,HI,DI], index_k [B,N,DI],
    weights [B,S,HI], index_k_scale [B,N] f32, q_start [B] int32,
    row_ranges [B,S,3|0] int32. Returns int32 [B, S, 1, topk]."""
    problem = contract.check_canonical(index_q, index_k, weights, index_k_scale, q_start, row_ranges)
    B, S, N = problem.B, problem.S, problem.N
    if problem.is_empty:
        return jnp.full((B, S, 1, topk), -1, jnp.int32)
    C = min(int(chunk), S) if chunk else topk_chunk_rows(problem, topk)
    has_ranges = bool(row_ranges.shape[-1])

    def one(args):
        iq, ik, w, ks, q0, rr = args

        def body(start, _, carry):
            q_rows = jax.lax.dynamic_slice_in_dim(iq, start, C, axis=0)
            w_rows = jax.lax.dynamic_slice_in_dim(w, start, C, axis=0)
            s_rows = start + jnp.arange(C, dtype=jnp.int32)
            ranges = jax.lax.dynamic_slice_in_dim(rr, start, C, axis=0) if has_ranges else None
            begin, end = row_key_ranges(s_rows, q0, ranges, N=N, causal=causal, k_stride=k_stride)
            n = jnp.arange(N, dtype=jnp.int32)
            valid = (n[None, :] >= begin[:, None]) & (n[None, :] < end[:, None])
            logits = chunk_logits(q_rows, w_rows, ik, ks, scale=scale, dtype=problem.dtype)
            return (select_topk(logits, valid, topk),), carry

        (out,), _ = row_loop(body, S, C, [((topk,), jnp.int32)], None)
        return out

    out = jax.lax.map(one, (index_q, index_k, weights, index_k_scale.astype(jnp.float32), q_start, row_ranges))
    return out[:, :, None, :]
