"""``jax.vmap`` of ``attn_dist``: the batching rule of ``attn_dist_p``.

The primitive has a native leading batch dimension B on every operand, so a
vmapped axis of size V folds into it: each operand's vmapped axis moves to the
front (operands that are not vmapped are broadcast to V), ``[V, B, ...]``
merges to ``[V * B, ...]``, the primitive is bound once, and its
``[V * B, G, S, T]`` result splits back to ``[V, B, G, S, T]``. One launch, no
loop; nested vmaps apply the rule once per level. Every (batch element, query
row) is computed independently, so the result equals a Python loop over the
vmapped axis.

Under explicit sharding (``jax.sharding.AxisType.Explicit``) the fold runs
with those mesh axes made automatic (``jax.sharding.auto_axes``); the result
keeps q's sharding of V, B and S and indices' sharding of T.

Note: an operand that is not vmapped is materialised V times (e.g. a shared
``k`` under ``vmap`` over ``q`` only), since the kernel reads k per batch
element.

``jax.vmap`` over the public ``attn_dist`` with unbatched per-example inputs
needs nothing more: ``attn_dist`` adds B = 1, and this rule folds the vmapped
axis into it.
"""

from __future__ import annotations

import jax
from jax.interpreters import batching

from .primitive import attn_dist_p
from .sharding import dim_specs, run_with_auto_axes


def _to_front(x, axis, size: int):
    if axis is None:  # not mapped
        return jax.lax.broadcast(x, (size,))
    return jax.numpy.moveaxis(x, axis, 0)


def attn_dist_batch_rule(batched_args, batch_dims, **params):
    sizes = {x.shape[d] for x, d in zip(batched_args, batch_dims) if d is not None}
    if len(sizes) != 1:
        raise ValueError(f"attn_dist: vmapped operands disagree on the mapped axis size: {sorted(sizes)}")
    (V,) = sizes
    front = [_to_front(x, d, V) for x, d in zip(batched_args, batch_dims)]

    def fold(*front):
        B = front[0].shape[1]
        merged = [x.reshape((V * B,) + tuple(x.shape[2:])) for x in front]
        out = attn_dist_p.bind(*merged, **params)
        return out.reshape((V, B) + tuple(out.shape[1:]))

    def out_sharding():  # [V, B, G, S, T]: V, B, S as q, T as indices
        q_spec, i_spec = dim_specs(front[0]), dim_specs(front[2])
        return jax.sharding.PartitionSpec(q_spec[0], q_spec[1], None, q_spec[2], i_spec[4])

    return run_with_auto_axes(fold, front, out_sharding), 0


batching.primitive_batchers[attn_dist_p] = attn_dist_batch_rule
