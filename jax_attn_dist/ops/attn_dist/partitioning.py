"""How attn_dist partitions over several devices (the driver is
``_core/partitioning.py``).

Besides B and S (every op), attn_dist may shard ``t`` (indices' T) and
``h`` in whole groups of 64 heads: when H is a multiple of 64, HK = 1 and
G > 1 the Shardy rule writes q's and lse's head dimension as the compound
factor ``(g, hg)`` with ``hg`` = 64 and the output's G dimension as ``g``;
the partition accepts a head sharding only when every shard holds a whole
number of groups (``H % (64 * shards) == 0``), otherwise heads are gathered.
A shard holding slots ``j*T_local ..`` gets SPEC §6's ``topk_length`` less
``j*T_local``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.custom_partitioning import CompoundFactor

from ..._core.partitioning import Decision, OpPartitioning, mesh_size, read_spec, sdy_rule, shard_start
from .contract import HEADS_PER_GROUP


def heads_shardable(H: int, HK: int) -> bool:
    """Whether attn_dist's head dimension can be split in whole 64-head groups
    at all (it then also needs ``H % (64 * shards) == 0``)."""
    return HK == 1 and H % HEADS_PER_GROUP == 0 and H // HEADS_PER_GROUP > 1


class AttnDistDecision(Decision):
    """attn_dist: B, S and (whole 64-head groups of) H from q; T from indices."""

    def __init__(self, mesh, shapes, shardings):
        super().__init__(mesh, shapes, shardings)
        H, HK = shapes[0][2], shapes[1][2]
        q_spec = read_spec(shardings[0], mesh, 4)
        i_spec = read_spec(shardings[2], mesh, 4)
        self.h = self.take(q_spec[2], H // HEADS_PER_GROUP) if heads_shardable(H, HK) else ()
        self.T = shapes[2][3]
        self.t = self.take(i_spec[3], self.T)
        self.t_local = self.T // mesh_size(mesh, self.t)

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
    return sdy_rule(operands, (("b", "g", "s", "t"),), replicated, **sizes)


#: attn_dist_p's operands (q, k, indices, lse, q_start, row_ranges) and
#: static parameters, in bind order.
PARTITIONING = OpPartitioning(6, ("sm_scale", "causal", "k_stride", "lse_base", "implementation"), 4, 5,
                              attn_dist_rule, AttnDistDecision, False)
