"""An independent float64 NumPy evaluation of SPEC §2, §5, §6, §8 and §9 (no
jax), one module per op (``attn_dist``, ``indexer``, ``sparse_mla``,
``indexer_topk``) over the shared validity rule.

Written from docs/SPEC.md alone, sharing no code with the jnp paths: the
demo checks its result against it on every machine, the CPU tests check the
jnp paths and the GPU tests the CUDA kernels. Inputs are taken exactly:
bf16/f16/f32 values convert to float64 without rounding (through float32);
integer arithmetic is int64 with Python's floor division. Meant for test-sized
problems (it materialises [S, H, T] arrays per batch element).
"""

from __future__ import annotations

from .attn_dist import (
    ATTN_DIST_TOLERANCE,
    HEADS_PER_GROUP,
    assert_within_spec,
    attn_dist_oracle,
    exact_lse,
    spec_errors,
)
from .indexer import (
    INDEXER_TOLERANCE,
    assert_indexer_close,
    indexer_error,
    indexer_grads_oracle,
    indexer_kl_oracle,
    indexer_lse_oracle,
)
from .indexer_topk import (
    TOPK_TOLERANCE,
    TOPK_TOLERANCE_FP8_KERNEL,
    assert_topk_acceptable,
    exact_topk,
    indexer_topk_logits_oracle,
    selection_band,
    topk_selection_error,
)
from .sparse_mla import (
    SPARSE_MLA_LSE_TOLERANCE,
    SPARSE_MLA_OUT_TOLERANCE,
    sparse_mla_grads_oracle,
    sparse_mla_oracle,
)
from .validity import packed_owner, packed_valid_mask, to_f64, valid_mask

__all__ = [
    "ATTN_DIST_TOLERANCE", "HEADS_PER_GROUP", "INDEXER_TOLERANCE", "assert_indexer_close", "assert_within_spec",
    "attn_dist_oracle", "exact_lse", "indexer_error", "indexer_grads_oracle", "indexer_kl_oracle",
    "indexer_lse_oracle", "packed_owner", "packed_valid_mask", "spec_errors", "to_f64", "valid_mask",
    "TOPK_TOLERANCE", "TOPK_TOLERANCE_FP8_KERNEL", "assert_topk_acceptable", "exact_topk",
    "indexer_topk_logits_oracle", "selection_band", "topk_selection_error",
    "SPARSE_MLA_LSE_TOLERANCE", "SPARSE_MLA_OUT_TOLERANCE", "sparse_mla_grads_oracle", "sparse_mla_oracle",
]
