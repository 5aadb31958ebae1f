"""jax_attn_dist: DeepSeek Sparse Attention's indexer loss for JAX.

* :func:`attn_dist`: per-head-group attention probabilities on each query's
  top-k keys (the indexer's target; docs/SPEC.md §2).
* :func:`indexer_kl`, :func:`indexer_loss`: the lightning indexer's KL loss
  (docs/SPEC.md §5).
* All three take packed sequences (``cu_seqlens_q``/``cu_seqlens_k``) and
  per-row top-k lengths (``topk_length``), docs/SPEC.md §6;
  :func:`cu_seqlens_from_segment_ids` builds the boundaries.

``python -m jax_attn_dist`` runs a demo.
"""

from ._contract import HEADS_PER_GROUP, indexer_kernel_supports, kernel_supports
from .api import attn_dist, indexer_kl, indexer_loss, kernel_available
from .indexer_primitive import indexer_kl_p
from .packing import cu_seqlens_from_segment_ids
from .primitive import attn_dist_p
from .reference import attn_dist_reference, indexer_kl_reference

__version__ = "0.2.0"

__all__ = [
    "HEADS_PER_GROUP",
    "__version__",
    "attn_dist",
    "attn_dist_p",
    "attn_dist_reference",
    "cu_seqlens_from_segment_ids",
    "indexer_kernel_supports",
    "indexer_kl",
    "indexer_kl_p",
    "indexer_kl_reference",
    "indexer_loss",
    "kernel_available",
    "kernel_supports",
]
