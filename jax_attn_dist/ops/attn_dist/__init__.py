"""attn_dist: per-head-group attention probabilities on each query's top-k
keys, from the sparse MLA forward's log-sum-exp (SPEC §2)."""

from .api import attn_dist
from .contract import HEADS_PER_GROUP, kernel_supports
from .primitive import attn_dist_p
from .reference import attn_dist_reference

__all__ = ["HEADS_PER_GROUP", "attn_dist", "attn_dist_p", "attn_dist_reference", "kernel_supports"]
