"""Seeded random inputs for the tests (CPU and GPU). Not a test file."""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np

from jax_attn_dist import oracle

from jax_attn_dist._core.checks import INT32_MAX
from jax_attn_dist._core.checks import INT32_MIN

#: q_start values at the int32 limits (SPEC §6.2 and §9.2: the causal rule is
#: exact for every int32 q_start): near INT32_MIN no key is visible, near
#: INT32_MAX every key in range; a rule formed in int32 (q_start + s + 1 -
#: k_stride) wraps around and flips them.
INT32_LIMIT_STARTS = (INT32_MIN, INT32_MIN + 3, INT32_MAX - 5, INT32_MAX)


def register_kernels() -> None:
    """Registers the extension's FFI targets (the test-only poisoned ones
    included) for the GPU case modules. An extension problem under
    JAX_ATTN_DIST_REQUIRE_GPU raises here; conftest's gpu marker reports it
    per test instead, so it is not raised at import."""
    from jax_attn_dist._core import ext

    try:
        ext.ensure_registered()
    except RuntimeError:
        pass


def require_ffi_targets(*targets) -> None:
    """Registers the kernels, then skips the test (fails under
    JAX_ATTN_DIST_REQUIRE_GPU) if the built extension predates one of
    ``targets``: it does not register it."""
    import pytest

    from jax_attn_dist._core import ext

    register_kernels()
    module = ext.extension_module()
    registered = dict(module.registrations()) if module is not None else {}
    missing = [t for t in targets if t not in registered]
    if missing:
        why = f"the CUDA extension does not register {missing} (registered: {sorted(registered)})"
        if ext.required_gpus():
            pytest.fail(f"{ext.REQUIRE_GPU_ENV} is set, but {why}", pytrace=False)
        pytest.skip(why)


def seed_of(*parts) -> int:
    """A stable seed from the test's parameters (failures reproduce)."""
    return zlib.crc32(repr(parts).encode())


def make_inputs(
    seed, *, S, H, D, N, T, B=None, HK=1, dtype=jnp.bfloat16, causal=True, k_stride=1,
    q_start_index=None, lse_base="2", sm_scale=None, lse_noise=0.0, index_low=-3, index_high=None,
    indices="uniform", invalid_fraction=0.3, nonfinite_lse=False,
):
    """Random attn_dist inputs: q/k/indices and an lse consistent with them,
    the one generator of attn_dist problems (the kernel cases of
    ``attn_dist_cases.py`` are records of its arguments).

    Returns (q, k, indices, lse, kwargs) with jax arrays and attn_dist kwargs.

    ``indices``: "uniform" draws every slot from [index_low, index_high)
    (default [-3, N + 3)); "sweep" (HK = 1) takes valid slots uniformly from
    each row's visible keys (duplicates included) and a fraction
    ``invalid_fraction`` of the slots (every slot of a row that sees no key)
    from every kind of bad index (see :func:`sweep_q_start_and_indices`).
    ``q_start_index``: None draws a random int (possibly negative) that leaves
    a mix of visible and invisible keys; "batch" draws a [B] int32 array
    (with "sweep": the start of every batch element as an int32 [B] array,
    one shared value or, with "batch", one each).
    ``lse`` is the float64 oracle's exact LSE rounded to float32, plus uniform
    noise of amplitude ``lse_noise`` (then rows no longer sum to 1), with
    ``nonfinite_lse`` three entries set to +inf, -inf and NaN (those heads
    give 0, never NaN).
    """
    rng = np.random.default_rng(seed)
    Bc = B if B is not None else 1
    lead = (B,) if B is not None else ()
    sm_scale = float(D ** -0.5 * rng.uniform(0.5, 2.0)) if sm_scale is None else sm_scale
    q = jnp.asarray(rng.standard_normal(lead + (S, H, D)).astype(np.float32), dtype)
    k = jnp.asarray(rng.standard_normal(lead + (N, HK, D)).astype(np.float32), dtype)
    if indices == "sweep":
        assert HK == 1 and B is not None, "sweep indices: HK = 1, batched"
        q_start_index, idx = sweep_q_start_and_indices(
            rng, B=B, S=S, T=T, N=N, k_stride=k_stride, causal=causal,
            per_batch_q_start=isinstance(q_start_index, str) and q_start_index == "batch",
            invalid_fraction=invalid_fraction)
        indices = jnp.asarray(idx)
    else:
        assert indices == "uniform", indices
        hi = N + 3 if index_high is None else index_high
        indices = jnp.asarray(rng.integers(index_low, hi, lead + (S, HK, T)), jnp.int32)
        span = max(N * k_stride, 1)
        if q_start_index is None:
            q_start_index = int(rng.integers(-4, span))
        elif isinstance(q_start_index, str) and q_start_index == "batch":
            q_start_index = jnp.asarray(rng.integers(-4, span, (Bc,)), jnp.int32)
    kwargs = dict(sm_scale=sm_scale, causal=causal, q_start_index=q_start_index, k_stride=k_stride, lse_base=lse_base)
    lse = oracle.exact_lse(q, k, indices, **kwargs)
    if lse_noise:
        lse = lse + rng.uniform(-lse_noise, lse_noise, lse.shape)
    if nonfinite_lse:
        flat = lse.reshape(-1)
        pick = rng.choice(flat.size, size=min(3, flat.size), replace=False)
        flat[pick] = np.array([np.inf, -np.inf, np.nan])[: len(pick)]
    lse = jnp.asarray(lse.astype(np.float32))
    return q, k, indices, lse, kwargs


def make_indexer_inputs(
    seed, *, S, HI, DI, N, T, B=None, dtype=jnp.bfloat16, weights_dtype=jnp.float32, causal=True, k_stride=1,
    q_start_index=None, scale=None, zero_rows=0.15, invalid_fraction=0.25,
):
    """Random indexer_kl inputs: (index_q, index_k, weights, indices, target, kwargs).

    indices mix valid keys (with duplicates) and every kind of invalid one
    (INT32_MIN, -1, N, INT32_MAX, causally invisible); the target is a random
    distribution over all T slots -- so some of its mass sits on invalid
    slots -- with zeros sprinkled in and ``zero_rows`` of the rows all zero.
    ``q_start_index``: None draws an int, "batch" an int32 [B] array.
    """
    rng = np.random.default_rng(seed)
    Bc = B if B is not None else 1
    lead = (B,) if B is not None else ()
    scale = float(rng.uniform(0.5, 2.0)) if scale is None else scale
    index_q = jnp.asarray((rng.standard_normal(lead + (S, HI, DI)) * DI ** -0.25).astype(np.float32), dtype)
    index_k = jnp.asarray((rng.standard_normal(lead + (N, DI)) * DI ** -0.25).astype(np.float32), dtype)
    weights = jnp.asarray((rng.standard_normal(lead + (S, HI)) * HI ** -0.5).astype(np.float32), weights_dtype)
    span = max(N * k_stride, 1)
    if q_start_index is None:
        q_start_index = int(rng.integers(-4, span))
    elif isinstance(q_start_index, str) and q_start_index == "batch":
        q_start_index = jnp.asarray(rng.integers(-4, span, (Bc,)), jnp.int32)
    idx = rng.integers(0, max(N, 1), lead + (S, 1, T)).astype(np.int64)
    idx[..., 1::7] = idx[..., ::7][..., : idx[..., 1::7].shape[-1]]  # duplicates
    bad = np.array([INT32_MIN, -1, N, N + 5, INT32_MAX], np.int64)[rng.integers(0, 5, idx.shape)]
    idx = np.where(rng.random(idx.shape) < invalid_fraction, bad, idx)
    indices = jnp.asarray(idx.astype(np.int32))
    target = rng.random(lead + (S, T)) * (rng.random(lead + (S, T)) < 0.8)
    target = target / np.maximum(target.sum(-1, keepdims=True), 1e-30)
    target[rng.random(lead + (S,)) < zero_rows] = 0.0
    target = jnp.asarray(target.astype(np.float32))
    kwargs = dict(scale=scale, causal=causal, q_start_index=q_start_index, k_stride=k_stride)
    return index_q, index_k, weights, indices, target, kwargs


def sweep_q_start_and_indices(rng, *, B, S, T, N, k_stride, causal, per_batch_q_start, invalid_fraction):
    """(q_start [B] int32, indices [B, S, 1, T] int32) for the kernel sweeps.

    Valid slots are uniform over each row's visible keys, with replacement
    (duplicates); a fraction ``invalid_fraction`` of the slots (and every slot
    of a row that sees no key) hold every kind of bad index: INT32_MIN, -1,
    -7, N, N + 1, INT32_MAX, INT32_MAX - 5 and, when causal, keys that exist
    but are not visible yet."""
    if per_batch_q_start:
        q_start = rng.integers(-3, N * k_stride, (B,)).astype(np.int32)
    else:
        q_start = np.full((B,), rng.integers(-3, N * k_stride), np.int32)
    s = np.arange(S)
    limit = (q_start[:, None].astype(np.int64) + s[None] + 1 - k_stride) // k_stride  # [B, S], floor
    visible = np.minimum(limit, N - 1) if causal else np.full((B, S), N - 1)
    u = rng.random((B, S, 1, T))
    idx = np.floor(u * (np.maximum(visible, 0)[:, :, None, None] + 1)).astype(np.int64)
    bad_pool = np.array([INT32_MIN, -1, -7, N, N + 1, INT32_MAX, INT32_MAX - 5], np.int64)
    bad = bad_pool[rng.integers(0, len(bad_pool), idx.shape)]
    if causal:
        future = np.clip(limit[:, :, None, None] + 1 + rng.integers(0, 5, idx.shape), 0, N - 1)
        bad = np.where((rng.random(idx.shape) < 0.3) & (future > limit[:, :, None, None]), future, bad)
    make_bad = rng.random(idx.shape) < invalid_fraction
    make_bad |= (visible < 0)[:, :, None, None]  # nothing visible: every slot invalid
    return q_start, np.where(make_bad, bad, idx).astype(np.int32)


def sweep_choices(axes: dict, count: int, rng):
    """Yields ``count`` configurations for a kernel sweep: the first 8 take
    value i (mod len) of every axis, so that each listed value of each axis
    appears; the rest are random draws. A batch-less choice never has a
    per-batch q_start. The caller may draw more from ``rng`` between yields."""
    for i in range(count):
        choice = {name: values[i % len(values)] if i < 8 else values[rng.integers(len(values))]
                  for name, values in axes.items()}
        if choice["B"] is None:
            choice["per_batch_q_start"] = False
        yield i, choice
