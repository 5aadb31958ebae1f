"""``jax.vmap`` of the logical primitives: one batching rule for every op.

Every logical primitive has a native leading batch dimension B on every
operand and result, so a vmapped axis of size V folds into it: each operand's
vmapped axis moves to the front (operands that are not vmapped are broadcast
to V), ``[V, B, ...]`` merges to ``[V * B, ...]``, the primitive is bound once,
and each ``[V * B, ...]`` result splits back to ``[V, B, ...]``. One launch,
no loop; nested vmaps apply the rule once per level. Every (batch element,
query row) is computed independently, so the result equals a Python loop over
the vmapped axis.

Under explicit sharding (``jax.sharding.AxisType.Explicit``) the fold runs
with those mesh axes made automatic (``jax.sharding.auto_axes``); each result
keeps the sharding of the operand it follows (its V, B and S dimensions).

Note: an operand that is not vmapped is materialised V times (e.g. a shared
``k`` under ``vmap`` over ``q`` only), since the kernels read the keys per
batch element.

``jax.vmap`` over the public functions with unbatched per-example inputs
needs nothing more: they add B = 1, and this rule folds the vmapped axis into
it.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.interpreters import batching

from .explicit_axes import run_with_auto_axes


def _to_front(x, axis, size: int):
    if axis is None:  # not mapped
        return jax.lax.broadcast(x, (size,))
    return jax.numpy.moveaxis(x, axis, 0)


def fold_batch_rule(prim, out_specs: Callable):
    """The batching rule of ``prim``. ``out_specs(front)`` gives the
    PartitionSpec of each ``[V, B, ...]`` result from the operands moved to
    the front (used only under explicit sharding)."""

    def rule(batched_args, batch_dims, **params):
        sizes = {x.shape[d] for x, d in zip(batched_args, batch_dims) if d is not None}
        if len(sizes) != 1:
            raise ValueError(f"{prim.name}: vmapped operands disagree on the mapped axis size: {sorted(sizes)}")
        (V,) = sizes
        front = [_to_front(x, d, V) for x, d in zip(batched_args, batch_dims)]

        def fold(*front):
            B = front[0].shape[1]
            merged = [x.reshape((V * B,) + tuple(x.shape[2:])) for x in front]
            outs = prim.bind(*merged, **params)
            split = lambda o: o.reshape((V, B) + tuple(o.shape[1:]))  # noqa: E731
            return tuple(split(o) for o in outs) if prim.multiple_results else split(outs)

        out = run_with_auto_axes(fold, front, lambda: out_specs(front))
        return (list(out), [0] * len(out)) if prim.multiple_results else (out, 0)

    return rule


def register_batching(prim, out_specs: Callable) -> None:
    """Makes ``jax.vmap`` of ``prim`` fold the vmapped axis into its batch
    dimension (:func:`fold_batch_rule`)."""
    batching.primitive_batchers[prim] = fold_batch_rule(prim, out_specs)
