"""Reverse-mode autodiff: ``jax.custom_vjp`` rules around the canonical binds
of ``attn_dist_p`` and ``indexer_kl_p``.

* attn_dist (SPEC §2.6): gradients to q, k and lse; the forward saves only
  its inputs and the backward (``backward.attn_dist_bwd_canonical``, chunked
  jnp) recomputes the probabilities.
* indexer_kl (SPEC §5.3): gradients to index_q, index_k and weights; the
  forward saves its inputs and the per-row log-sum-exp (a [B, S] residual;
  no [B, S, HI, T] one); the backward is the logical primitive
  ``indexer_kl_bwd_p`` (partitioned like the forward, S-shards' d index_k
  psum'ed). ``target`` gets a zero cotangent: it is the stop-gradient teacher.

``indices``, ``q_start`` and ``row_ranges`` are integers: no gradient (float0 under
``allow_int``). Forward mode (``jax.jvp``) is not provided.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
from jax.sharding import PartitionSpec as P

from .backward import attn_dist_bwd_canonical
from .explicit_axes import dim_specs, run_with_auto_axes
from .indexer_primitive import indexer_kl_bwd_p, indexer_kl_p
from .primitive import attn_dist_p


# ----------------------------------------------------------------------------
# attn_dist
# ----------------------------------------------------------------------------


def _bind(q, k, indices, lse, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, implementation):
    return attn_dist_p.bind(
        q, k, indices, lse, q_start, row_ranges, sm_scale=sm_scale, causal=causal, k_stride=k_stride,
        lse_base=lse_base, implementation=implementation,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _attn_dist_vjp(q, k, indices, lse, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, implementation):
    return _bind(q, k, indices, lse, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, implementation)


def _attn_dist_fwd(q, k, indices, lse, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, implementation):
    out = _bind(q, k, indices, lse, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, implementation)
    return out, (q, k, indices, lse, q_start, row_ranges)


def _attn_dist_bwd(sm_scale, causal, k_stride, lse_base, implementation, residuals, g):
    q, k, indices, lse, q_start, row_ranges = residuals
    bwd = functools.partial(
        attn_dist_bwd_canonical, sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base,
    )
    dq, dk, dlse = run_with_auto_axes(
        bwd, (q, k, indices, lse, q_start, row_ranges, g), lambda: tuple(P(*dim_specs(x)) for x in (q, k, lse)),
    )
    return dq, dk, None, dlse, None, None  # indices, q_start, row_ranges: integer, no gradient


_attn_dist_vjp.defvjp(_attn_dist_fwd, _attn_dist_bwd)


def attn_dist_canonical(
    q, k, indices, lse, q_start, row_ranges, *, sm_scale: float, causal: bool, k_stride: int,
    lse_base: str, implementation: Optional[str],
):
    """``attn_dist_p.bind`` on canonical operands, differentiable w.r.t. q, k
    and lse (static parameters already checked)."""
    return _attn_dist_vjp(q, k, indices, lse, q_start, row_ranges, sm_scale, causal, k_stride, lse_base,
                          implementation)


# ----------------------------------------------------------------------------
# indexer_kl
# ----------------------------------------------------------------------------


def _indexer_params(scale, causal, k_stride, deterministic, implementation):
    return dict(scale=scale, causal=causal, k_stride=k_stride, deterministic=deterministic,
                implementation=implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _indexer_vjp(index_q, index_k, weights, indices, target, q_start, row_ranges, scale, causal, k_stride,
                 deterministic, implementation):
    kl, _ = indexer_kl_p.bind(index_q, index_k, weights, indices, target, q_start, row_ranges,
                              **_indexer_params(scale, causal, k_stride, deterministic, implementation))
    return kl


def _indexer_fwd(index_q, index_k, weights, indices, target, q_start, row_ranges, scale, causal, k_stride,
                 deterministic, implementation):
    operands = (index_q, index_k, weights, indices, target, q_start, row_ranges)
    kl, lse = indexer_kl_p.bind(*operands, **_indexer_params(scale, causal, k_stride, deterministic,
                                                             implementation))
    return kl, (*operands, lse)


def _indexer_bwd(scale, causal, k_stride, deterministic, implementation, residuals, g):
    # `implementation="cuda"` binds the forward to its kernel; the backward
    # uses its kernel wherever it applies (HI <= 64, either mode) and
    # the jnp pass elsewhere, so "cuda" becomes None here.
    params = _indexer_params(scale, causal, k_stride, deterministic,
                             None if implementation == "cuda" else implementation)
    index_q, index_k, weights = residuals[:3]
    d_index_q, d_index_k, d_weights = run_with_auto_axes(
        lambda *a: tuple(indexer_kl_bwd_p.bind(*a, **params)), (*residuals, g),
        lambda: tuple(P(*dim_specs(x)) for x in (index_q, index_k, weights)),
    )
    # target: the stop-gradient teacher, a zero cotangent; indices, q_start, row_ranges: integers
    return d_index_q, d_index_k, d_weights, None, None, None, None


_indexer_vjp.defvjp(_indexer_fwd, _indexer_bwd)


def indexer_kl_canonical(index_q, index_k, weights, indices, target, q_start, row_ranges, *, scale: float,
                         causal: bool, k_stride: int, deterministic: bool, implementation: Optional[str]):
    """``indexer_kl_p.bind`` on canonical operands returning ``kl`` [B, S],
    differentiable w.r.t. index_q, index_k and weights (static parameters
    already checked)."""
    return _indexer_vjp(index_q, index_k, weights, indices, target, q_start, row_ranges, scale, causal, k_stride,
                        deterministic, implementation)
