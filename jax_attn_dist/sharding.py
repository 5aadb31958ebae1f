"""Multi-device partitioning of ``attn_dist_p`` (``custom_partitioning``).

The outer, logical primitive ``attn_dist_p`` lowers through
:func:`partitioned_lowering`: a ``jax.experimental.custom_partitioning``
function whose per-shard body binds the inner primitive (``attn_dist_local_p``,
same operands and parameters, lowered per platform to the CUDA kernel or the
jnp reference). On one device, and inside a ``shard_map`` whose axes are all
manual, custom_partitioning simply inlines the body, so the inner primitive
sees the operands as they are.

Canonical operands and factors (Shardy sharding rule)::

    q        [B, S, H, D]     b s h d
    k        [B, N, HK, D]    b n hk d
    indices  [B, S, HK, T]    b s hk t
    lse      [B, S, H]        b s h
    q_start  [B]              b
    out      [B, G, S, T]     b g s t

* ``b``, ``s`` and ``t`` may be sharded; the output follows. Every output
  element (b, g, s, j) depends only on row (b, s) of q/lse/indices, slot j of
  indices and the whole of k[b], so each shard computes its block alone.
* Sharding ``s`` moves each shard's causal offset: the shard holding rows
  ``i*S_local ..`` gets ``q_start + i*S_local``, with ``i`` from
  ``jax.lax.axis_index`` over the mesh axes that shard S (computed inside the
  per-shard function; no collective). The CUDA kernel computes every slot
  independently, so the sharded result equals the unsharded one bit for bit.
* ``h`` may be sharded in whole groups of 64 heads: when H is a multiple of
  64, HK = 1 and G > 1, the rule writes q's and lse's head dimension as the
  compound factor ``(g, hg)`` with ``hg`` = 64, and the output's G dimension
  as ``g``. The partition accepts a head sharding only when every shard holds
  a whole number of groups (``H % (64 * shards) == 0``); otherwise (H not a
  multiple of 64, HK > 1, or a split inside a group) heads are gathered:
  q and lse are all-gathered over H and the output is not sharded over G.
* ``n``, ``hk`` and ``d`` are replicated: k is all-gathered if it arrives
  sharded over N, HK or D; q's D likewise.

No other collective is inserted. The partition callback reads the operands'
shardings and decides (``Decision``): q gives B, S and H, indices gives T;
operands that disagree are resharded to match by XLA. The legacy GSPMD
propagation (``jax_use_shardy_partitioner=False``) is served by the same
decision through ``infer_sharding_from_operands``.

Inside a ``shard_map`` every shard sees its own rows: the caller passes each
shard's ``q_start_index`` (``q_start_index + axis_index("sp") * S_local``).
In a ``shard_map`` that leaves some mesh axes automatic, jax's
custom_partitioning has no mesh; the inner primitive is then bound directly
and XLA partitions it over the automatic axes like any other op.
"""

from __future__ import annotations

import functools
import warnings
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import (
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from ._contract import HEADS_PER_GROUP

_INT32_MAX = np.iinfo(np.int32).max

#: Positions of the static parameters (sm_scale, causal, k_stride, lse_base,
#: implementation), which follow the five operands.
_STATIC_ARGNUMS = (5, 6, 7, 8, 9)


# ----------------------------------------------------------------------------
# which dimensions may be sharded
# ----------------------------------------------------------------------------


def heads_shardable(H: int, HK: int) -> bool:
    """Whether the head dimension can be split in whole 64-head groups at all
    (it then also needs ``H % (64 * shards) == 0``)."""
    return HK == 1 and H % HEADS_PER_GROUP == 0 and H // HEADS_PER_GROUP > 1


def sharding_rule(*static_and_mesh_and_types):
    """Shardy rule (called by custom_partitioning with the static parameters,
    the mesh, and the MLIR operand and result types)."""
    operand_types = static_and_mesh_and_types[-2]
    q_shape = tuple(operand_types[0].shape)
    k_shape = tuple(operand_types[1].shape)
    H, HK = q_shape[2], k_shape[2]
    need_replication = ["n", "hk", "d"]
    if heads_shardable(H, HK):
        h = CompoundFactor("g", "hg")
        sizes = {"hg": HEADS_PER_GROUP}
        need_replication.append("hg")
    else:
        # Heads cannot be split in whole groups: gathered (replicated).
        h = "h"
        sizes = {}
        need_replication += ["h", "g"]
    operands = (
        ("b", "s", h, "d"),       # q
        ("b", "n", "hk", "d"),    # k
        ("b", "s", "hk", "t"),    # indices
        ("b", "s", h),            # lse
        ("b",),                   # q_start
    )
    results = (("b", "g", "s", "t"),)
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
        need_replication_factors=tuple(sorted(need_replication, key=order.index)),
        **sizes,
    )


def _axes(entry) -> Tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(a for a in entry if a is not None)
    return (entry,)


def _spec(sharding, mesh, ndim: int) -> Tuple[Tuple[str, ...], ...]:
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
                       "attn_dist call is gathered (correct, but slow)")
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


def _size(mesh, axes: Sequence[str]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64)) if axes else 1


class Decision:
    """The mesh axes that shard B, S, H (and G) and T, from the operands'
    shardings: q decides B, S and H; indices decides T. Axes already used by
    an earlier dimension are dropped, and a split that does not apply
    (heads not in whole groups) is replaced by replication."""

    def __init__(self, mesh, shapes, shardings):
        q_shape, k_shape, i_shape = shapes[0], shapes[1], shapes[2]
        B, S, H, _ = q_shape
        HK, T = k_shape[2], i_shape[3]
        q_spec = _spec(shardings[0], mesh, 4)
        i_spec = _spec(shardings[2], mesh, 4)
        used = set()

        def take(axes, size):
            """The longest prefix of ``axes`` that is free and splits
            ``size`` (the per-shard unit) evenly; marks it used."""
            kept = []
            for a in axes:
                if a in used or a not in mesh.shape:
                    break
                kept.append(a)
            # An uneven (padded) split would stay correct for B, S and T, but
            # keep every shard's block whole and exact.
            while kept and size % _size(mesh, kept) != 0:
                kept.pop()
            used.update(kept)
            return tuple(kept)

        self.mesh = mesh
        self.b = take(q_spec[0], B)
        self.s = take(q_spec[1], S)
        # Heads: only in whole 64-head groups, i.e. the group count G splits.
        self.h = take(q_spec[2], H // HEADS_PER_GROUP) if heads_shardable(H, HK) else ()
        self.t = take(i_spec[3], T)
        self.s_local = S // _size(mesh, self.s)

    def named(self, *entries):
        return NamedSharding(self.mesh, P(*(_entry(e) for e in entries)))

    @property
    def arg_shardings(self):
        b, s, h, t = self.b, self.s, self.h, self.t
        return (
            self.named(b, s, h, ()),      # q
            self.named(b, (), (), ()),    # k
            self.named(b, s, (), t),      # indices
            self.named(b, s, h),          # lse
            self.named(b),                # q_start
        )

    @property
    def out_sharding(self):
        return self.named(self.b, self.h, self.s, self.t)


def shard_offset(q_start, s_axes: Tuple[str, ...], s_local: int):
    """``q_start + i * s_local`` for the shard with index ``i`` over ``s_axes``
    (int32; clamped at INT32_MAX instead of wrapping, which is exact for
    k_stride = 1 and for every position that fits in int32)."""
    if not s_axes:
        return q_start
    offset = (jax.lax.axis_index(s_axes) * s_local).astype(jnp.int32)
    return jnp.where(q_start > _INT32_MAX - offset, jnp.int32(_INT32_MAX), q_start + offset)


# ----------------------------------------------------------------------------
# the custom_partitioning function
# ----------------------------------------------------------------------------


def partitioned_lowering(inner_p):
    """Returns the MLIR lowering rule of the outer primitive: a
    custom_partitioning function whose per-shard body binds ``inner_p``."""

    def bind(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation):
        return inner_p.bind(
            q, k, indices, lse, q_start, sm_scale=sm_scale, causal=causal,
            k_stride=k_stride, lse_base=lse_base, implementation=implementation,
        )

    fn = custom_partitioning(bind, static_argnums=_STATIC_ARGNUMS)

    def partition(sm_scale, causal, k_stride, lse_base, implementation, mesh, arg_shapes, result_shape):
        decision = _decide(mesh, arg_shapes)
        s_axes, s_local = decision.s, decision.s_local

        def per_shard(q, k, indices, lse, q_start):
            q_start = shard_offset(q_start, s_axes, s_local)
            return bind(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation)

        return mesh, per_shard, decision.out_sharding, decision.arg_shardings

    def infer_sharding_from_operands(sm_scale, causal, k_stride, lse_base, implementation, mesh, arg_shapes, result_shape):
        return _decide(mesh, arg_shapes).out_sharding

    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=sharding_rule,
        # We read the operands' shardings ourselves (see _spec): jax's decoding
        # fails on the Shardy sub-axis shardings that a head split inside a
        # group can give the result.
        decode_shardings=False,
    )

    def call(q, k, indices, lse, q_start, *, sm_scale, causal, k_stride, lse_base, implementation):
        return fn(q, k, indices, lse, q_start, sm_scale, causal, k_stride, lse_base, implementation)

    lower_call = mlir.lower_fun(call, multiple_results=False)
    lower_inner = mlir.lower_fun(functools.partial(_bind_kw, inner_p), multiple_results=False)

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


def _bind_kw(inner_p, *args, **params):
    return inner_p.bind(*args, **params)


_PARTLY_MANUAL = (
    "attn_dist: cannot partition a call inside a shard_map over a subset of the "
    "mesh axes; make every mesh axis manual (the shard_map default) and pass "
    "each shard's q_start_index, or use jax.jit with shardings"
)


def register_partitioned_lowering(outer_p, inner_p) -> None:
    """Makes ``outer_p`` lower through the custom_partitioning function that
    binds ``inner_p`` per shard."""
    mlir.register_lowering(outer_p, partitioned_lowering(inner_p))
    # custom_partitioning needs the device assignment while lowering; jit
    # supplies it only for jaxprs holding a primitive of this registry (a
    # private one, used the same way by jax's own cuDNN wrappers and by
    # TransformerEngine). Without it, multi-device lowering fails.
    try:
        from jax._src import dispatch

        dispatch.prim_requires_devices_during_lowering.add(outer_p)
    except (ImportError, AttributeError) as e:  # private: must never break the import
        _warn_once(f"jax internals changed ({e}); attn_dist may fail to lower for several devices")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn("jax_attn_dist.sharding: " + message, RuntimeWarning, stacklevel=3)


def _decide(mesh, arg_shapes) -> Decision:
    if mesh.empty:
        raise NotImplementedError(
            "attn_dist: a sharded call needs a mesh: shard its inputs with "
            "NamedSharding (jax.jit in_shardings/out_shardings, device_put) or "
            "call it under `with jax.set_mesh(mesh)`"
        )
    shapes = [tuple(a.shape) for a in arg_shapes]
    shardings = [a.sharding for a in arg_shapes]
    if any(_partly_manual(s, len(shape), mesh) for s, shape in zip(shardings, shapes)):
        raise NotImplementedError(_PARTLY_MANUAL)
    return Decision(mesh, shapes, shardings)


def _partly_manual(sharding, ndim: int, mesh) -> bool:
    """In a shard_map that leaves some mesh axes automatic, XLA partitions the
    call once per manual group, on shardings over that group's devices only
    (answering with shardings over the whole mesh crashes XLA)."""
    if isinstance(sharding, NamedSharding):
        return False
    try:
        from jax._src.lib import xla_client as xc

        hlo = sharding._to_xla_hlo_sharding(ndim)
        if hlo.is_tiled() and len(hlo.tile_assignment_devices()) != mesh.size:
            return True
        return hlo.is_manual() or xc.OpSharding.Type.MANUAL in hlo.subgroup_types()
    except Exception:
        return False


# ----------------------------------------------------------------------------
# explicit sharding (jax.sharding.AxisType.Explicit, the default of
# jax.make_mesh): the jnp code of the backward (autodiff.py) and of the vmap
# fold (batching.py) merges and splits dimensions, which explicitly-sharded
# types do not allow in general, so it runs with those axes made automatic
# (XLA partitions it), giving results sharded as given.
# ----------------------------------------------------------------------------


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
