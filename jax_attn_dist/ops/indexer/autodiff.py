"""The indexer's reverse-mode autodiff: a ``jax.custom_vjp`` around the
canonical bind of ``indexer_kl_p`` (SPEC §5.3).

Gradients go to index_q, index_k and weights; the forward saves its inputs
and the per-row log-sum-exp (a [B, S] residual; no [B, S, HI, T] one); the
backward is the logical primitive ``indexer_kl_bwd_p`` (partitioned like the
forward, S-shards' d index_k psum'ed). ``target`` gets a zero cotangent: it
is the stop-gradient teacher. ``indices``, ``q_start`` and ``row_ranges``
are integers: no gradient. Forward mode (``jax.jvp``) is not provided.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
from jax.sharding import PartitionSpec as P

from ..._core.explicit_axes import dim_specs, run_with_auto_axes
from .primitive import indexer_kl_bwd_p, indexer_kl_p


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
