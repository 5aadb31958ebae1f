"""indexer_topk under autodiff: the canonical bind behind
:func:`backward.detach`, so that no tangent reaches the primitive (SPEC
§9.4: no gradient; the float inputs get zero cotangents, the integer
indices float0 ones)."""

from __future__ import annotations

from typing import Optional

from .backward import detach
from .primitive import indexer_topk_p


def indexer_topk_canonical(index_q, index_k, weights, index_k_scale, q_start, row_ranges, *, topk: int,
                           scale: float, causal: bool, k_stride: int, implementation: Optional[str]):
    """``indexer_topk_p.bind`` on canonical operands (static parameters
    already checked): int32 indices [B, S, 1, topk]."""
    operands = detach(index_q, index_k, weights, index_k_scale, q_start, row_ranges)
    return indexer_topk_p.bind(*operands, topk=topk, scale=scale, causal=causal, k_stride=k_stride,
                               implementation=implementation)
