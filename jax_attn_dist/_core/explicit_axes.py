"""Explicitly-sharded operands (``jax.sharding.AxisType.Explicit``, the
default of ``jax.make_mesh``).

The jnp code around the primitives -- the vmap fold (``batching.py``) and the
custom VJPs' cotangent plumbing (``autodiff.py``) -- merges and splits
dimensions, which explicitly-sharded types do not allow in general. It runs
with those mesh axes made automatic (``jax.sharding.auto_axes``, so XLA
partitions it) and returns results sharded as given.
"""

from __future__ import annotations

import jax


def _explicit_axes(xs):
    """(abstract mesh, names of its Explicit axes) of the first operand whose
    type is sharded over an Explicit mesh axis; (None, ()) if none is."""
    explicit = jax.sharding.AxisType.Explicit
    for x in xs:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        names = getattr(mesh, "axis_names", ())
        types = getattr(mesh, "axis_types", ())
        axes = tuple(n for n, t in zip(names, types) if t == explicit)
        if axes:
            return mesh, axes
    return None, ()


def dim_specs(x) -> tuple:
    """The PartitionSpec entries of x's type, one per dimension."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def run_with_auto_axes(fn, args, out_sharding):
    """``fn(*args)``; when an operand is typed with Explicit mesh axes, runs it
    under ``jax.sharding.auto_axes`` over those axes with outputs sharded as
    ``out_sharding()`` (a PartitionSpec, or a tuple of them for several outputs;
    PartitionSpec objects, so that a compound entry like ("a", "b") in one
    output's spec is never mistaken for several outputs)."""
    mesh, axes = _explicit_axes(args)
    if not axes:
        return fn(*args)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_sharding())(*args)
