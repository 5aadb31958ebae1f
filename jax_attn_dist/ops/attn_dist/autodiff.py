"""attn_dist's reverse-mode autodiff: a ``jax.custom_vjp`` around the
canonical bind of ``attn_dist_p`` (SPEC §2.6).

Gradients go to q, k and lse; the forward saves only its inputs and the
backward (``backward.attn_dist_bwd_canonical``, chunked jnp) recomputes the
probabilities. ``indices``, ``q_start`` and ``row_ranges`` are integers: no
gradient (float0 under ``allow_int``). Forward mode (``jax.jvp``) is not
provided.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
from jax.sharding import PartitionSpec as P

from ..._core.explicit_axes import dim_specs, run_with_auto_axes
from .backward import attn_dist_bwd_canonical
from .primitive import attn_dist_p


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
