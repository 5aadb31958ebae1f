"""The lightning indexer's KL loss: ``indexer_kl`` against a given target,
and ``indexer_loss`` with the target from attn_dist (SPEC §5)."""

from .api import indexer_kl, indexer_loss
from .contract import kernel_supports
from .primitive import indexer_kl_bwd_p, indexer_kl_p
from .reference import indexer_kl_reference

__all__ = ["indexer_kl", "indexer_kl_bwd_p", "indexer_kl_p", "indexer_kl_reference", "indexer_loss",
           "kernel_supports"]
