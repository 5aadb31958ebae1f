"""Multi-device partitioning of the logical primitives (``custom_partitioning``).

Each op's logical primitives lower through :func:`partitioned_lowering`: a
``jax.experimental.custom_partitioning`` function whose per-shard body binds
the op's inner primitive (same operands and parameters, lowered per platform
to a CUDA kernel or the jnp path). On one device, and inside a ``shard_map``
whose axes are all manual, custom_partitioning simply inlines the body, so the
inner primitive sees the operands as they are. What differs per op is an
:class:`OpPartitioning`: its Shardy rule and its :class:`Decision`, in the
op's own ``partitioning`` module.

Every op is row-parallel: the leading canonical dimensions of its
"rows" operand (``q`` / ``index_q``) are B and S, and every output row
(b, s) depends only on row (b, s) of the row operands and on the whole key
array of batch element b. So:

* ``b`` and ``s`` may be sharded; outputs follow. Sharding ``s`` moves each
  shard's causal offset: the shard holding rows ``i*S_local ..`` gets
  ``q_start + i*S_local``, with ``i`` from ``jax.lax.axis_index`` over the
  mesh axes that shard S (inside the per-shard function; no collective). The
  kernels compute every row independently, so sharded results equal the
  unsharded ones bit for bit.
* SPEC §6's per-row ranges (``row_ranges`` [B, S, 3], or [B, S, 0]) are
  sharded with their rows: their key ranges are absolute positions and
  need no offset; their ``topk_length`` counts the row's slots from 0, so a
  shard holding slots ``j*T_local ..`` (attn_dist with T sharded) gets it
  less ``j*T_local`` (``Decision.localize``).
* key arrays (``k``, ``index_k``) are replicated: all-gathered if they arrive
  sharded over N or D (any query may select any key).
* Each op's ``Decision`` subclass adds what else may be sharded (attn_dist:
  T and whole 64-head groups) and, where a result sums over rows (a key
  gradient), ``psum``s each S-shard's partial sum in ``finish`` (or, where
  the shards must first agree on a fixed-point scale, computes the shard in
  ``run``).

The partition callback reads the operands' shardings and decides
(``Decision``): the rows operand gives B and S, the op's subclass the rest;
operands that disagree are resharded by XLA. The legacy GSPMD propagation
(``jax_use_shardy_partitioner=False``) is served by the same decision through
``infer_sharding_from_operands``.

Inside a ``shard_map`` every shard sees its own rows: the caller passes each
shard's ``q_start_index`` (``q_start_index + axis_index("sp") * S_local``).
In a ``shard_map`` that leaves some mesh axes automatic, jax's
custom_partitioning has no mesh; the inner primitive is then bound directly
and XLA partitions it over the automatic axes like any other op.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from .checks import INT32_MAX


# ----------------------------------------------------------------------------
# reading shardings
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn("jax_attn_dist.sharding: " + message, RuntimeWarning, stacklevel=3)


def _axes(entry) -> Tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(a for a in entry if a is not None)
    return (entry,)


def read_spec(sharding, mesh, ndim: int) -> Tuple[Tuple[str, ...], ...]:
    """The mesh axes sharding each dimension, major to minor. A sharding that
    names no whole mesh axes (e.g. Shardy's sub-axes, or no mesh) reads as
    replicated: the partition then asks for a replicated operand."""
    spec = None
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
    elif sharding is not None and not mesh.empty:
        try:  # private jax API: a jax that moves it must not silently gather everything
            from jax._src.sharding_impls import parse_flatten_op_sharding

            to_hlo = sharding._to_xla_hlo_sharding
        except (ImportError, AttributeError) as e:
            _warn_once(f"cannot read operand shardings with this jax ({e}); every operand of a sharded "
                       "call is gathered (correct, but slow)")
            return ((),) * ndim
        try:
            spec = tuple(parse_flatten_op_sharding(to_hlo(ndim), mesh)[0])
        except Exception:  # not expressible in whole mesh axes
            spec = None
    if spec is None:
        return ((),) * ndim
    spec = spec + (None,) * (ndim - len(spec))
    return tuple(_axes(e) for e in spec[:ndim])


def _entry(axes: Sequence[str]):
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def mesh_size(mesh, axes: Sequence[str]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64)) if axes else 1


# ----------------------------------------------------------------------------
# decisions: which mesh axes shard which dimension
# ----------------------------------------------------------------------------


class Decision:
    """The mesh axes that shard B and S, from the rows operand's sharding
    (operand 0, canonical ``[B, S, ...]``). Subclasses add dimensions and
    define ``arg_shardings`` / ``out_shardings`` and, where a result is a
    partial sum over rows, ``finish``."""

    def __init__(self, mesh, shapes, shardings):
        self.mesh = mesh
        self.used = set()
        B, S = shapes[0][:2]
        rows_spec = read_spec(shardings[0], mesh, len(shapes[0]))
        self.b = self.take(rows_spec[0], B)
        self.s = self.take(rows_spec[1], S)
        self.s_local = S // mesh_size(mesh, self.s)

    def take(self, axes, size: int) -> Tuple[str, ...]:
        """The longest prefix of ``axes`` that is free and splits ``size`` (the
        per-shard unit) evenly; marks it used. (An uneven, padded split would
        stay correct for B, S and T, but keeps every shard's block whole.)"""
        kept = []
        for a in axes:
            if a in self.used or a not in self.mesh.shape:
                break
            kept.append(a)
        while kept and size % mesh_size(self.mesh, kept) != 0:
            kept.pop()
        self.used.update(kept)
        return tuple(kept)

    def named(self, *entries):
        return NamedSharding(self.mesh, P(*(_entry(e) for e in entries)))

    def localize(self, operands, op: "OpPartitioning"):
        """Per-shard operands (a list, changed in place): what is counted
        from the start of a sharded dimension moves by the shard's offset.
        Here ``q_start``, by the shard's first row when S is sharded."""
        i = op.q_start_operand
        operands[i] = shard_offset(operands[i], self.s, self.s_local)

    def finish(self, outs):
        """Per-shard post-processing of the inner primitive's results."""
        return outs

    def run(self, bind, operands, params):
        """The per-shard computation on the shard's (localized) operands:
        the inner primitive (``bind(*operands)``), then ``finish``. An op
        whose shards must agree on something before computing (``params``:
        the static parameters by name) overrides it."""
        return self.finish(bind(*operands))


# ----------------------------------------------------------------------------
# Shardy rules
# ----------------------------------------------------------------------------


def sdy_rule(operands, results, replicated, **sizes) -> SdyShardingRule:
    # The MLIR verifier wants special factors in the order in which the
    # factors are numbered (first appearance); jax passes them as given.
    order = []
    for mapping in operands + results:
        for dim in mapping:
            for f in (dim if isinstance(dim, tuple) else (dim,)):
                if f not in order:
                    order.append(f)
    return SdyShardingRule(
        operand_mappings=operands,
        result_mappings=results,
        need_replication_factors=tuple(sorted(set(replicated), key=order.index)),
        **sizes,
    )


# ----------------------------------------------------------------------------
# the custom_partitioning function
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpPartitioning:
    """How one logical primitive partitions: its operand count, the names of
    its static parameters (in bind order, after the operands), the positions
    of its ``q_start`` and ``row_ranges`` operands, its Shardy rule and its
    Decision class."""

    num_operands: int
    param_names: Tuple[str, ...]
    q_start_operand: int
    row_ranges_operand: int
    rule: Callable
    decision: type
    multiple_results: bool


def shard_start(axes: Tuple[str, ...], local: int):
    """``i * local`` (int32) for the shard with index ``i`` over ``axes``: the
    global index of its first element along a dimension split into pieces of
    ``local``."""
    return (jax.lax.axis_index(axes) * local).astype(jnp.int32)


def shard_offset(q_start, s_axes: Tuple[str, ...], s_local: int):
    """``q_start + shard_start(s_axes, s_local)`` (int32; clamped at
    INT32_MAX instead of wrapping, which is exact for k_stride = 1 and for
    every position that fits in int32)."""
    if not s_axes:
        return q_start
    offset = shard_start(s_axes, s_local)
    return jnp.where(q_start > INT32_MAX - offset, jnp.int32(INT32_MAX), q_start + offset)


def partitioned_lowering(inner_p, op: OpPartitioning):
    """Returns the MLIR lowering rule of a logical primitive: a
    custom_partitioning function whose per-shard body binds ``inner_p``."""
    n = op.num_operands

    def bind(*args):
        operands, static = args[:n], args[n:]
        return inner_p.bind(*operands, **dict(zip(op.param_names, static)))

    fn = custom_partitioning(bind, static_argnums=tuple(range(n, n + len(op.param_names))))

    def partition(*static_mesh_shapes):
        *static, mesh, arg_shapes, result_shape = static_mesh_shapes
        decision = _decide(op, mesh, arg_shapes)

        def per_shard(*operands):
            operands = list(operands)
            decision.localize(operands, op)
            return decision.run(lambda *x: bind(*x, *static), operands, dict(zip(op.param_names, static)))

        return mesh, per_shard, out_shardings(decision), decision.arg_shardings

    def infer_sharding_from_operands(*static_mesh_shapes):
        *_, mesh, arg_shapes, result_shape = static_mesh_shapes
        return out_shardings(_decide(op, mesh, arg_shapes))

    def out_shardings(decision):  # custom_partitioning wants a list for several results
        return list(decision.out_shardings) if op.multiple_results else decision.out_shardings

    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=op.rule,
        # We read the operands' shardings ourselves (see read_spec): jax's decoding
        # fails on the Shardy sub-axis shardings that a head split inside a
        # group can give the result.
        decode_shardings=False,
    )

    def call(*operands, **params):
        return fn(*operands, *(params[name] for name in op.param_names))

    lower_call = mlir.lower_fun(call, multiple_results=op.multiple_results)
    lower_inner = mlir.lower_fun(inner_p.bind, multiple_results=op.multiple_results)

    def lowering(ctx, *args, **params):
        axis_context = getattr(ctx.module_context, "axis_context", None)
        manual = getattr(axis_context, "manual_axes", None)
        mesh = getattr(axis_context, "mesh", None)
        if manual and mesh is not None and set(manual) != set(mesh.axis_names):
            # A shard_map that leaves some mesh axes automatic: jax's
            # custom_partitioning has no mesh there (and XLA partitions per
            # manual group). Bind the inner primitive directly on the
            # per-manual-shard operands; XLA partitions it over the automatic
            # axes like any op (the kernel's custom call gets replicated
            # operands there), so the result stays exact.
            return lower_inner(ctx, *args, **params)
        return lower_call(ctx, *args, **params)

    return lowering


def register_partitioned_lowering(outer_p, inner_p, op: OpPartitioning) -> None:
    """Makes ``outer_p`` lower through the custom_partitioning function that
    binds ``inner_p`` per shard."""
    mlir.register_lowering(outer_p, partitioned_lowering(inner_p, op))
    # custom_partitioning needs the device assignment while lowering; jit
    # supplies it only for jaxprs holding a primitive of this registry (a
    # private one, used the same way by jax's own cuDNN wrappers and by
    # TransformerEngine). Without it, multi-device lowering fails.
    try:
        from jax._src import dispatch

        dispatch.prim_requires_devices_during_lowering.add(outer_p)
    except (ImportError, AttributeError) as e:  # private: must never break the import
        _warn_once(f"jax internals changed ({e}); jax_attn_dist may fail to lower for several devices")


_PARTLY_MANUAL = (
    "jax_attn_dist: cannot partition a call inside a shard_map over a subset of the "
    "mesh axes; make every mesh axis manual (the shard_map default) and pass "
    "each shard's q_start_index, or use jax.jit with shardings"
)


def _decide(op: OpPartitioning, mesh, arg_shapes) -> Decision:
    if mesh.empty:
        raise NotImplementedError(
            "jax_attn_dist: a sharded call needs a mesh: shard its inputs with "
            "NamedSharding (jax.jit in_shardings/out_shardings, device_put) or "
            "call it under `with jax.set_mesh(mesh)`"
        )
    shapes = [tuple(a.shape) for a in arg_shapes]
    shardings = [a.sharding for a in arg_shapes]
    if any(_partly_manual(s, len(shape), mesh) for s, shape in zip(shardings, shapes)):
        raise NotImplementedError(_PARTLY_MANUAL)
    return op.decision(mesh, shapes, shardings)


def _partly_manual(sharding, ndim: int, mesh) -> bool:
    """In a shard_map that leaves some mesh axes automatic, XLA partitions the
    call once per manual group, on shardings over that group's devices only
    (answering with shardings over the whole mesh crashes XLA)."""
    if sharding is None or isinstance(sharding, NamedSharding):
        return False
    try:
        from jax._src.lib import xla_client as xc

        hlo = sharding._to_xla_hlo_sharding(ndim)
        if hlo.is_tiled() and len(hlo.tile_assignment_devices()) != mesh.size:
            return True
        return hlo.is_manual() or xc.OpSharding.Type.MANUAL in hlo.subgroup_types()
    except Exception as e:  # private API: say so instead of silently assuming "not manual"
        _warn_once(f"cannot inspect an operand sharding with this jax ({type(e).__name__}: {e}); "
                   "assuming it is not a partly-manual shard_map sharding")
        return False
