"""How the indexer's primitives partition over several devices (the driver
is ``_core/partitioning.py``).

B and S may be sharded (every op); T and HI are gathered (the per-row
softmax over T and the sum over heads would otherwise need collectives). The
backward's ``d index_k`` sums over every row: each S-shard computes the
partial sum of its rows and ``finish`` ``psum``s it over the S axes. With
``deterministic`` on the kernel and B or S sharded, ``run`` instead has the
shards agree on the one fixed-point scale and add their integer sums
exactly (``sharded_fixed_point.py``): the unsharded call's bits.
"""

from __future__ import annotations

import jax

from ..._core import fixed_point
from ..._core.partitioning import Decision, OpPartitioning, mesh_size, sdy_rule
from . import sharded_fixed_point


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

    def run(self, bind, operands, params):
        """With ``deterministic`` on the CUDA kernel and B or S sharded, the
        shards first agree on the one fixed-point scale (every row's bound,
        B and S shards alike) and then add their exact integer sums over the
        S shards (``sharded_fixed_point.py``)."""
        if not (params["deterministic"] and (self.b or self.s)
                and sharded_fixed_point.kernel_serves(operands, params, self.mesh)):
            return super().run(bind, operands, params)
        B, S = operands[0].shape[:2]
        rows = B * mesh_size(self.mesh, self.b) * S * mesh_size(self.mesh, self.s)
        fixed_point.check_shard_count(mesh_size(self.mesh, self.s), "indexer_kl backward", rows)
        return sharded_fixed_point.sharded_deterministic_backward(
            operands, params, bound_axes=self.b + self.s, sum_axes=self.s, scale_rows=rows)


_INDEXER_OPERANDS = (("b", "s", "h", "d"), ("b", "n", "d"), ("b", "s", "h"), ("b", "s", "one", "t"),
                     ("b", "s", "t"), ("b",), ("b", "s", "r"))
_INDEXER_REPLICATED = ("h", "d", "n", "one", "t", "r")


def indexer_rule(*static_and_mesh_and_types):
    """indexer_kl forward: index_q b s h d; index_k b n d; weights b s h;
    indices b s one t; target b s t; q_start b; row_ranges b s r -> kl,
    lse b s."""
    return sdy_rule(_INDEXER_OPERANDS, (("b", "s"), ("b", "s")), _INDEXER_REPLICATED)


def indexer_bwd_rule(*static_and_mesh_and_types):
    """indexer_kl backward: the forward's operands, lse b s, g b s ->
    d index_q b s h d, d index_k b n d, d weights b s h."""
    operands = _INDEXER_OPERANDS + (("b", "s"), ("b", "s"))
    results = (("b", "s", "h", "d"), ("b", "n", "d"), ("b", "s", "h"))
    return sdy_rule(operands, results, _INDEXER_REPLICATED)


_PARAMS = ("scale", "causal", "k_stride", "deterministic", "implementation")
#: indexer_kl_p: (index_q, index_k, weights, indices, target, q_start,
#: row_ranges) -> (kl, lse); indexer_kl_bwd_p: the same plus (lse, g) ->
#: (d index_q, d index_k, d weights).
FWD_PARTITIONING = OpPartitioning(7, _PARAMS, 5, 6, indexer_rule, IndexerDecision, True)
BWD_PARTITIONING = OpPartitioning(9, _PARAMS, 5, 6, indexer_bwd_rule, IndexerBwdDecision, True)
