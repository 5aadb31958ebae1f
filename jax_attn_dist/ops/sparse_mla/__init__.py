"""sparse_mla: sparse MLA attention over each query's top-k keys, returning
the output and the per-head log-sum-exp that attn_dist consumes (SPEC §8)."""

from .api import sparse_mla
from .contract import kernel_supports
from .primitive import sparse_mla_bwd_p, sparse_mla_p
from .reference import sparse_mla_reference

__all__ = ["kernel_supports", "sparse_mla", "sparse_mla_bwd_p", "sparse_mla_p", "sparse_mla_reference"]
