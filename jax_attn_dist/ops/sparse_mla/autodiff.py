"""sparse_mla's reverse-mode autodiff: a ``jax.custom_vjp`` around the
canonical bind of ``sparse_mla_p`` (SPEC §8.3).

Gradients go to q and kv from the cotangents of both results, ``out`` and
``lse``. The forward saves its inputs, ``out`` and ``lse`` (no [B, S, H, T]
residual: the probabilities are recomputed); the backward is the logical
primitive ``sparse_mla_bwd_p`` (partitioned like the forward, S- and
H-shards' dkv psum'ed), lowered to the SM90 backward kernel where it
applies (its row preprocess reads ``out``) and to the chunked jnp pass
elsewhere. ``indices``, ``q_start`` and ``row_ranges`` are integers: no
gradient. Forward mode (``jax.jvp``) is not provided.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
from jax.sharding import PartitionSpec as P

from ..._core.explicit_axes import dim_specs, run_with_auto_axes
from .primitive import sparse_mla_bwd_p, sparse_mla_p


def _bind(q, kv, indices, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, d_v, deterministic,
          implementation):
    out, lse = sparse_mla_p.bind(
        q, kv, indices, q_start, row_ranges, sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base,
        d_v=d_v, deterministic=deterministic, implementation=implementation,
    )
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11))
def _sparse_mla_vjp(q, kv, indices, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, d_v, deterministic,
                    implementation):
    return _bind(q, kv, indices, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, d_v, deterministic,
                 implementation)


def _sparse_mla_fwd(q, kv, indices, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, d_v, deterministic,
                    implementation):
    out, lse = _bind(q, kv, indices, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, d_v, deterministic,
                     implementation)
    return (out, lse), (q, kv, indices, q_start, row_ranges, out, lse)


def _sparse_mla_bwd(sm_scale, causal, k_stride, lse_base, d_v, deterministic, implementation, residuals, cotangents):
    # `implementation="cuda"` binds the forward to its kernel; the backward
    # uses its kernel wherever it applies and the jnp pass elsewhere, so
    # "cuda" becomes None here.
    params = dict(sm_scale=sm_scale, causal=causal, k_stride=k_stride, lse_base=lse_base, d_v=d_v,
                  deterministic=deterministic, implementation=None if implementation == "cuda" else implementation)
    q, kv = residuals[:2]
    dout, dlse = cotangents
    dq, dkv = run_with_auto_axes(
        lambda *a: tuple(sparse_mla_bwd_p.bind(*a, **params)), (*residuals, dout, dlse),
        lambda: tuple(P(*dim_specs(x)) for x in (q, kv)),
    )
    # dkv comes back float32 (summed over shards first), rounded once here
    return dq, dkv.astype(kv.dtype), None, None, None  # indices, q_start, row_ranges: integer, no gradient


_sparse_mla_vjp.defvjp(_sparse_mla_fwd, _sparse_mla_bwd)


def sparse_mla_canonical(
    q, kv, indices, q_start, row_ranges, *, sm_scale: float, causal: bool, k_stride: int, lse_base: str,
    d_v: int, deterministic: bool, implementation: Optional[str],
):
    """``sparse_mla_p.bind`` on canonical operands returning ``(out, lse)``,
    differentiable w.r.t. q and kv (static parameters already checked)."""
    return _sparse_mla_vjp(q, kv, indices, q_start, row_ranges, sm_scale, causal, k_stride, lse_base, d_v,
                           deterministic, implementation)
