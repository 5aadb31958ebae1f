"""Multi-device partitioning of the logical primitives (``custom_partitioning``).

Each logical primitive (``attn_dist_p``, ``indexer_kl_p``,
``indexer_kl_bwd_p``) lowers through :func:`partitioned_lowering`: a
``jax.experimental.custom_partitioning`` function whose per-shard body binds
the op's inner primitive (same operands and parameters, lowered per platform
to a CUDA kernel or the jnp path). On one device, and inside a ``shard_map``
whose axes are all manual, custom_partitioning simply inlines the body, so the
inner primitive sees the operands as they are. What differs per op is an
:class:`OpPartitioning`: its Shardy rule and its :class:`Decision`.

Every op here is row-parallel: the leading canonical dimensions of its
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
* attn_dist: ``t`` (indices' T) may be sharded, and ``h`` in whole groups of
  64 heads: when H is a multiple of 64, HK = 1 and G > 1 the rule writes q's
  and lse's head dimension as the compound factor ``(g, hg)`` with ``hg`` =
  64 and the output's G dimension as ``g``; the partition accepts a head
  sharding only when every shard holds a whole number of groups
  (``H % (64 * shards) == 0``), otherwise heads are gathered.
* indexer_kl: T and HI are gathered (the per-row softmax over T and the sum
  over heads would otherwise need collectives). Its backward's
  ``d index_k`` sums over every row: each S-shard computes the partial sum
  of its rows and the per-shard function ``psum``s it over the S axes.

The partition callback reads the operands' shardings and decides
(``Decision``): the rows operand gives B, S (and H); attn_dist's indices give
T; operands that disagree are resharded by XLA. The legacy GSPMD propagation
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
from jax.experimental.custom_partitioning import (
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from ._contract import HEADS_PER_GROUP, INT32_MAX


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


def _size(mesh, axes: Sequence[str]) -> int:
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
        rows_spec = _spec(shardings[0], mesh, len(shapes[0]))
        self.b = self.take(rows_spec[0], B)
        self.s = self.take(rows_spec[1], S)
        self.s_local = S // _size(mesh, self.s)

    def take(self, axes, size: int) -> Tuple[str, ...]:
        """The longest prefix of ``axes`` that is free and splits ``size`` (the
        per-shard unit) evenly; marks it used. (An uneven, padded split would
        stay correct for B, S and T, but keeps every shard's block whole.)"""
        kept = []
        for a in axes:
            if a in self.used or a not in self.mesh.shape:
                break
            kept.append(a)
        while kept and size % _size(self.mesh, kept) != 0:
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


def heads_shardable(H: int, HK: int) -> bool:
    """Whether attn_dist's head dimension can be split in whole 64-head groups
    at all (it then also needs ``H % (64 * shards) == 0``)."""
    return HK == 1 and H % HEADS_PER_GROUP == 0 and H // HEADS_PER_GROUP > 1


class AttnDistDecision(Decision):
    """attn_dist: B, S and (whole 64-head groups of) H from q; T from indices."""

    def __init__(self, mesh, shapes, shardings):
        super().__init__(mesh, shapes, shardings)
        H, HK = shapes[0][2], shapes[1][2]
        q_spec = _spec(shardings[0], mesh, 4)
        i_spec = _spec(shardings[2], mesh, 4)
        self.h = self.take(q_spec[2], H // HEADS_PER_GROUP) if heads_shardable(H, HK) else ()
        self.T = shapes[2][3]
        self.t = self.take(i_spec[3], self.T)
        self.t_local = self.T // _size(mesh, self.t)

    @property
    def arg_shardings(self):
        b, s, h, t = self.b, self.s, self.h, self.t
        return (
            self.named(b, s, h, ()),      # q
            self.named(b, (), (), ()),    # k
            self.named(b, s, (), t),      # indices
            self.named(b, s, h),          # lse
            self.named(b),                # q_start
            self.named(b, s, ()),         # row_ranges
        )

    def localize(self, operands, op):
        super().localize(operands, op)
        ranges = operands[op.row_ranges_operand]
        if self.t and ranges.shape[-1]:
            # topk_length counts from the row's first slot; this shard's
            # first is shard_start(t). Clamped into [0, T] first (as the
            # kernels clamp it), so that the difference cannot wrap.
            length = jnp.clip(ranges[..., 2], 0, self.T) - shard_start(self.t, self.t_local)
            operands[op.row_ranges_operand] = ranges.at[..., 2].set(length)

    @property
    def out_shardings(self):
        return self.named(self.b, self.h, self.s, self.t)  # out [B, G, S, T]


class IndexerDecision(Decision):
    """indexer_kl forward: B and S from index_q; HI, DI, N and T whole."""

    @property
    def arg_shardings(self):
        b, s = self.b, self.s
        return (
            self.named(b, s, (), ()),     # index_q
            self.named(b, (), ()),        # index_k
            self.named(b, s, ()),         # weights
            self.named(b, s, (), ()),     # indices
            self.named(b, s, ()),         # target
            self.named(b),                # q_start
            self.named(b, s, ()),         # row_ranges
        )

    @property
    def out_shardings(self):
        return (self.named(self.b, self.s),) * 2  # kl, lse [B, S]


class IndexerBwdDecision(IndexerDecision):
    """indexer_kl backward: as the forward, plus lse and g [B, S]; d index_k
    is a sum over every row, so each S-shard's partial sum is psum'ed."""

    @property
    def arg_shardings(self):
        rows = self.named(self.b, self.s)
        return super().arg_shardings + (rows, rows)  # lse, g

    @property
    def out_shardings(self):
        b, s = self.b, self.s
        return (self.named(b, s, (), ()), self.named(b, (), ()), self.named(b, s, ()))  # dq, dk, dw

    def finish(self, outs):
        d_index_q, d_index_k, d_weights = outs
        if self.s:
            d_index_k = jax.lax.psum(d_index_k, self.s)
        return d_index_q, d_index_k, d_weights


# ----------------------------------------------------------------------------
# Shardy rules
# ----------------------------------------------------------------------------


def _sdy_rule(operands, results, replicated, **sizes) -> SdyShardingRule:
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


def attn_dist_rule(*static_and_mesh_and_types):
    """attn_dist: q b s h d; k b n hk d; indices b s hk t; lse b s h;
    q_start b; row_ranges b s r -> out b g s t (h = (g, hg) when heads
    split in groups)."""
    operand_types = static_and_mesh_and_types[-2]
    H, HK = tuple(operand_types[0].shape)[2], tuple(operand_types[1].shape)[2]
    replicated = ["n", "hk", "d", "r"]
    if heads_shardable(H, HK):
        h = CompoundFactor("g", "hg")
        sizes = {"hg": HEADS_PER_GROUP}
        replicated.append("hg")
    else:  # heads cannot be split in whole groups: gathered
        h = "h"
        sizes = {}
        replicated += ["h", "g"]
    operands = (("b", "s", h, "d"), ("b", "n", "hk", "d"), ("b", "s", "hk", "t"), ("b", "s", h), ("b",),
                ("b", "s", "r"))
    return _sdy_rule(operands, (("b", "g", "s", "t"),), replicated, **sizes)


_INDEXER_OPERANDS = (("b", "s", "h", "d"), ("b", "n", "d"), ("b", "s", "h"), ("b", "s", "one", "t"),
                     ("b", "s", "t"), ("b",), ("b", "s", "r"))
_INDEXER_REPLICATED = ("h", "d", "n", "one", "t", "r")


def indexer_rule(*static_and_mesh_and_types):
    """indexer_kl forward: index_q b s h d; index_k b n d; weights b s h;
    indices b s one t; target b s t; q_start b; row_ranges b s r -> kl,
    lse b s."""
    return _sdy_rule(_INDEXER_OPERANDS, (("b", "s"), ("b", "s")), _INDEXER_REPLICATED)


def indexer_bwd_rule(*static_and_mesh_and_types):
    """indexer_kl backward: the forward's operands, lse b s, g b s ->
    d index_q b s h d, d index_k b n d, d weights b s h."""
    operands = _INDEXER_OPERANDS + (("b", "s"), ("b", "s"))
    results = (("b", "s", "h", "d"), ("b", "n", "d"), ("b", "s", "h"))
    return _sdy_rule(operands, results, _INDEXER_REPLICATED)


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


ATTN_DIST = OpPartitioning(6, ("sm_scale", "causal", "k_stride", "lse_base", "implementation"), 4, 5,
                           attn_dist_rule, AttnDistDecision, False)
_INDEXER_PARAMS = ("scale", "causal", "k_stride", "deterministic", "implementation")
INDEXER_FWD = OpPartitioning(7, _INDEXER_PARAMS, 5, 6, indexer_rule, IndexerDecision, True)
INDEXER_BWD = OpPartitioning(9, _INDEXER_PARAMS, 5, 6, indexer_bwd_rule, IndexerBwdDecision, True)


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
            return decision.finish(bind(*operands, *static))

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
        # We read the operands' shardings ourselves (see _spec): jax's decoding
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
