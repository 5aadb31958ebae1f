"""jax_attn_dist: DeepSeek Sparse Attention's indexer loss for JAX.

* :func:`attn_dist`: per-head-group attention probabilities on each query's
  top-k keys (the indexer's target; docs/SPEC.md §2).
* :func:`indexer_kl`, :func:`indexer_loss`: the lightning indexer's KL loss
  (docs/SPEC.md §5).
* :func:`indexer_topk`: each query's top-k keys by the indexer's logits,
  the ``indices`` the other functions take (docs/SPEC.md §9; packed
  sequences too, ``topk_length`` does not apply).
* :func:`sparse_mla`: sparse MLA attention over the top-k keys, giving the
  output and the lse that attn_dist takes (docs/SPEC.md §8).
* All of them take packed sequences (``cu_seqlens_q``/``cu_seqlens_k``) and
  per-row top-k lengths (``topk_length``), docs/SPEC.md §6;
  :func:`cu_seqlens_from_segment_ids` builds the boundaries.
* :func:`dsa_attention`: the whole DSA attention layer in one call: the
  top-k, sparse MLA over it and the indexer's KL loss, with each input's
  gradients from its own output (docs/SPEC.md §10).
* :func:`kernel_status` says whether the CUDA kernels can run here.

Each op lives in its own package under ``jax_attn_dist.ops``; the machinery
they share is ``jax_attn_dist._core``; layers composed of ops (no kernel of
their own) live under ``jax_attn_dist.layers``. ``python -m jax_attn_dist``
runs a demo.
"""

from ._core import ext as _ext
from ._core.ext import kernel_status
from ._core.packing import cu_seqlens_from_segment_ids
from .ops.attn_dist import HEADS_PER_GROUP, attn_dist, attn_dist_p, attn_dist_reference
from .ops.attn_dist import kernel_supports as attn_dist_kernel_supports
from .ops.indexer import indexer_kl, indexer_kl_bwd_p, indexer_kl_p, indexer_kl_reference, indexer_loss
from .ops.indexer import kernel_supports as indexer_kernel_supports
from .ops.indexer_topk import indexer_topk
from .ops.indexer_topk import kernel_supports as indexer_topk_kernel_supports
from .ops.sparse_mla import kernel_supports as sparse_mla_kernel_supports
from .ops.sparse_mla import sparse_mla, sparse_mla_p, sparse_mla_reference
from .layers.dsa import DsaAttentionOutput, dsa_attention

__version__ = "0.3.0"

#: The earlier name of :func:`attn_dist_kernel_supports`.
kernel_supports = attn_dist_kernel_supports


def kernel_available() -> bool:
    """True when the CUDA kernels can run here: the compiled extension is
    built and registered with XLA, and jax sees a Hopper (sm_90) GPU.
    :func:`kernel_status` says which of the two is missing."""
    registered, gpus, _ = _ext.kernel_status()
    return registered and bool(gpus)


__all__ = [
    "DsaAttentionOutput",
    "HEADS_PER_GROUP",
    "__version__",
    "attn_dist",
    "attn_dist_kernel_supports",
    "attn_dist_p",
    "attn_dist_reference",
    "cu_seqlens_from_segment_ids",
    "dsa_attention",
    "indexer_kernel_supports",
    "indexer_kl",
    "indexer_kl_bwd_p",
    "indexer_kl_p",
    "indexer_kl_reference",
    "indexer_loss",
    "indexer_topk",
    "indexer_topk_kernel_supports",
    "kernel_available",
    "kernel_status",
    "kernel_supports",
    "sparse_mla",
    "sparse_mla_kernel_supports",
    "sparse_mla_p",
    "sparse_mla_reference",
]
