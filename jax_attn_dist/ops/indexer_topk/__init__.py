"""The lightning indexer's top-k selection: ``indexer_topk`` picks each
query row's ``topk`` keys by the indexer's logits (SPEC §9), as the
``indices`` of attn_dist, indexer_kl and sparse MLA."""

from .api import indexer_topk
from .contract import kernel_supports
from .primitive import indexer_topk_p
from .reference import indexer_topk_reference_canonical

__all__ = ["indexer_topk", "indexer_topk_p", "indexer_topk_reference_canonical", "kernel_supports"]
