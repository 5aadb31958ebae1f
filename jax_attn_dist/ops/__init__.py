"""The op families, one package each: its contract (checks and kernel
coverage), jnp reference and backward, primitives with their lowerings,
partitioning decision, custom VJP, public functions and kernel variant list.

Adding an op: a package here, its ``csrc/<op>/`` folder, its ``tests/<op>/``
folder, and one line in each registration list (the imports below, the
public names in ``jax_attn_dist/__init__.py``, ``csrc/module.cc``'s
registrations, CMakeLists.txt's variant lists).
"""

from . import attn_dist, indexer  # noqa: F401  (registers each op's primitives and rules)
from . import sparse_mla  # noqa: F401
from . import indexer_topk  # noqa: F401
