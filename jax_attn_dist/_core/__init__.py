"""Machinery shared by every op, one copy each: argument checks, extension
loading, the row-chunked jnp blocks and the index-validity rule, SPEC §6's
per-row ranges, primitive definition and lowering choice, the partitioning
driver, the vmap rule and explicit-sharding plumbing. Nothing here imports
an op."""
