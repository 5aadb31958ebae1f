"""Seeded random inputs for the indexer_topk tests (CPU and GPU), and the
float64 check of a selection. Not a test file."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from inputs import INT32_MAX, INT32_MIN
from jax_attn_dist.oracle import indexer_topk as topk_oracle

FP8 = jnp.float8_e4m3fn


def make_topk_inputs(seed, *, S, HI, DI, N, B=None, dtype=jnp.bfloat16, weights_dtype=jnp.float32, causal=True,
                     k_stride=1, q_start_index=None, scale=None, key_scale=False, repeat_keys=0):
    """(index_q, index_k, weights, kwargs) for indexer_topk.

    ``q_start_index``: None draws an int in [-3, N * k_stride) (so that some
    rows see fewer keys than others, some none), "batch" an int32 [B] array,
    an int is used as given. float8 inputs (and ``key_scale=True``) get a
    random positive ``index_k_scale`` in kwargs. ``repeat_keys``: that many
    keys are copies of key 0 (exact ties with a smaller index)."""
    rng = np.random.default_rng(seed)
    lead = (B,) if B is not None else ()
    index_q = rng.standard_normal(lead + (S, HI, DI)) * DI ** -0.25
    index_k = rng.standard_normal(lead + (N, DI)) * DI ** -0.25
    if repeat_keys:
        pick = rng.choice(np.arange(1, N), size=min(repeat_keys, N - 1), replace=False)
        index_k[..., pick, :] = index_k[..., :1, :]
    index_q = jnp.asarray(index_q.astype(np.float32), dtype)
    index_k = jnp.asarray(index_k.astype(np.float32), dtype)
    weights = jnp.asarray((rng.standard_normal(lead + (S, HI)) * HI ** -0.5).astype(np.float32), weights_dtype)
    span = max(N * k_stride, 1)
    if q_start_index is None:
        q_start_index = int(rng.integers(-3, span))
    elif isinstance(q_start_index, str):
        assert q_start_index == "batch" and B is not None
        q_start_index = jnp.asarray(rng.integers(-3, span, (B,)), jnp.int32)
    kwargs = dict(scale=float(rng.uniform(0.5, 2.0)) if scale is None else scale, causal=causal,
                  q_start_index=q_start_index, k_stride=k_stride)
    if key_scale or jnp.dtype(dtype) == jnp.dtype(FP8):
        kwargs["index_k_scale"] = jnp.asarray(rng.uniform(0.25, 4.0, lead + (N,)).astype(np.float32))
    return index_q, index_k, weights, kwargs


def negative_heads_inputs(seed, *, S, N, HI, DI):
    """(index_q, index_k, weights, kwargs) whose keys share one direction and
    whose queries oppose it: most heads' z are negative, so sum_h |w z| is
    about a hundred times a row's largest logit and most logits are exactly
    0 (bf16, positive weights, every key valid)."""
    rng = np.random.default_rng(seed)
    m = rng.standard_normal(DI)
    m /= np.linalg.norm(m)
    index_k = jnp.asarray((4.0 * m + rng.standard_normal((N, DI))).astype(np.float32), jnp.bfloat16)
    index_q = jnp.asarray((-4.0 * m + 0.2 * rng.standard_normal((S, HI, DI))).astype(np.float32), jnp.bfloat16)
    weights = jnp.asarray(np.abs(rng.standard_normal((S, HI))).astype(np.float32))
    return index_q, index_k, weights, dict(scale=1.0, causal=False, q_start_index=0, k_stride=1)


def cancellation(index_q, index_k, weights, logits):
    """Per row, max over keys of sum_h |w z| over the largest |logit| (float64;
    ``logits`` from oracle_logits): how far a logit is below the sizes of its
    terms."""
    z = np.einsum("shd,nd->shn", np.asarray(index_q, np.float64), np.asarray(index_k, np.float64))
    spread = np.einsum("sh,shn->sn", np.asarray(weights, np.float64), np.abs(z)).max(axis=1)
    return spread / np.abs(logits).max(axis=1)


def oracle_logits(index_q, index_k, weights, kwargs, **packing):
    """The float64 logits [B?, S, N] (-inf where not valid) of a call with
    these arguments (``kwargs`` as make_topk_inputs gives them, without
    ``topk``)."""
    kw = {k: v for k, v in kwargs.items() if k not in ("topk", "implementation")}
    if not isinstance(kw.get("q_start_index"), int):
        kw["q_start_index"] = np.asarray(kw["q_start_index"])
    if kw.get("index_k_scale") is not None:
        kw["index_k_scale"] = np.asarray(kw["index_k_scale"])
    return topk_oracle.indexer_topk_logits_oracle(index_q, index_k, weights, **kw, **packing)


def kernel_band(dtype):
    """SPEC §9.3's band for the CUDA kernel's selection on inputs of this dtype
    (float8: the tensor cores' shorter sums)."""
    return topk_oracle.TOPK_TOLERANCE_FP8_KERNEL if jnp.dtype(dtype) == jnp.dtype(FP8) else topk_oracle.TOPK_TOLERANCE


def check_selection(indices, index_q, index_k, weights, kwargs, topk, rtol=topk_oracle.TOPK_TOLERANCE, **packing):
    """indices [B?, S, 1, topk] is int32 and acceptable under SPEC §9.3 (the
    band ``rtol``) for every row; returns the float64 logits."""
    indices = np.asarray(indices)
    logits = oracle_logits(index_q, index_k, weights, kwargs, **packing)
    assert indices.dtype == np.int32, indices.dtype
    assert indices.shape == logits.shape[:-1] + (1, topk), (indices.shape, logits.shape)
    topk_oracle.assert_topk_acceptable(indices, logits, topk, rtol)
    return logits


def widest_band(indices, logits, topk):
    """The widest SPEC §9.3 band any row of ``indices`` needs (a measure,
    for reports; the check is check_selection)."""
    sel = np.asarray(indices).reshape(np.shape(logits)[:-1] + (topk,))
    return max(topk_oracle.selection_band(logits[pos], sel[pos], topk) for pos in np.ndindex(*np.shape(logits)[:-1]))


# ----------------------------------------------------------------------------
# q_start at the int32 limits, malformed boundaries and raw row ranges
# ----------------------------------------------------------------------------


def valid_counts(logits):
    """int [B?, S]: each row's number of valid keys (finite float64 logits)."""
    return np.isfinite(np.asarray(logits)).sum(-1)


def assert_row_kinds(logits, topk, kinds=("empty", "short", "select")):
    """The rows of ``logits`` include each of ``kinds``: "empty" (no valid
    key), "short" (0 < valid < topk: -1 padding after all of them) and
    "select" (more than topk valid keys). A test's own coverage check."""
    m = valid_counts(logits)
    have = dict(empty=(m == 0).any(), short=((m > 0) & (m < topk)).any(), select=(m > topk).any())
    missing = [k for k in kinds if not have[k]]
    assert not missing, f"the case has no {missing} rows (valid key counts {np.unique(m).tolist()}, topk {topk})"


def adversarial_topk_ranges(rng, B, S, N, topk):
    """int32 [B, S, 3] raw row ranges for indexer_topk's primitive (fields 0
    and 1: key begin and end; field 2, unused by indexer_topk, random):
    ordinary ranges mixed with negative values, values past N,
    INT32_MIN/MAX and ends before beginnings. The first rows of batch
    element 0 are fixed: 3 keys (from N - 3 to INT32_MAX), fewer than topk
    (from INT32_MIN), none (from past N to 2), every key (from -3 to
    INT32_MAX), exactly topk and topk + 1 keys. Needs B >= 1, S >= 6."""
    keys = np.array([INT32_MIN, INT32_MIN + 1, -N, -7, -1, 0, 1, N // 2, N - 1, N, N + 1, 2 * N, INT32_MAX - 1,
                     INT32_MAX], np.int64)
    begin = rng.integers(0, N, (B, S))
    end = begin + rng.integers(-3, N, (B, S))
    begin = np.where(rng.random((B, S)) < 0.35, keys[rng.integers(0, len(keys), (B, S))], begin)
    end = np.where(rng.random((B, S)) < 0.35, keys[rng.integers(0, len(keys), (B, S))], end)
    other = rng.integers(INT32_MIN, INT32_MAX, (B, S), endpoint=True)
    fixed = [(N - 3, INT32_MAX), (INT32_MIN, min(topk - 1, N)), (N + 5, 2), (-3, INT32_MAX),
             (N - min(topk, N), N), (N - min(topk + 1, N), 2 * N)]
    for s, (b0, e0) in enumerate(fixed):
        begin[0, s], end[0, s] = b0, e0
    out = np.stack([begin, end, other], axis=-1)
    return np.clip(out, INT32_MIN, INT32_MAX).astype(np.int32)


def raw_range_logits(index_q, index_k, weights, kwargs, row_ranges):
    """The float64 logits [B, S, N] (canonical, batched inputs) of a call on
    raw ``row_ranges`` [B, S, 3]: key n is valid for row s when
    ``clip(r0, 0, N) <= n < clip(r1, clip(r0, 0, N), N)`` (the clamp of SPEC
    §6, in int64), whatever ``causal``/``q_start_index`` say."""
    from packed_kernel_cases import key_bounds

    kw = dict(kwargs, causal=False, q_start_index=0)
    logits = oracle_logits(index_q, index_k, weights, kw)
    N = logits.shape[-1]
    begin, end = key_bounds(row_ranges, N)
    n = np.arange(N)
    valid = (n >= begin[..., None]) & (n < end[..., None])
    return np.where(valid, logits, -np.inf)
