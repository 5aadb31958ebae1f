"""jax_attn_dist: per-head-group attention probabilities on DSA's top-k keys.

See :func:`attn_dist` and SPEC §2. ``python -m jax_attn_dist`` runs a demo.
"""

from ._contract import HEADS_PER_GROUP, kernel_supports
from .primitive import attn_dist, attn_dist_p, kernel_available
from . import autodiff, batching  # noqa: F401  (custom VJP; registers the vmap rule)
from .reference import attn_dist_reference

__version__ = "0.1.0"

__all__ = [
    "HEADS_PER_GROUP",
    "__version__",
    "attn_dist",
    "attn_dist_p",
    "attn_dist_reference",
    "kernel_available",
    "kernel_supports",
]
