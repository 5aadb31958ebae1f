"""How indexer_topk's primitive partitions over several devices (the driver
is ``_core/partitioning.py``).

B and S may be sharded: every output row depends only on its own row of
index_q, weights and row_ranges and on the whole key arrays of its batch
element, which are replicated within it (index_k and index_k_scale are
all-gathered over N or DI if they arrive sharded). HI and DI are gathered
(every logit sums all heads and features); the topk slots are never split
(the selection needs the whole row). Sharding S moves each shard's q_start
by its first row (the driver's ``Decision.localize``); SPEC §6's row ranges
hold absolute key positions and move with their rows.
"""

from __future__ import annotations

from ..._core.partitioning import Decision, OpPartitioning, sdy_rule


class IndexerTopkDecision(Decision):
    """indexer_topk: B and S from index_q; HI, DI, N and topk whole."""

    @property
    def arg_shardings(self):
        b, s = self.b, self.s
        return (
            self.named(b, s, (), ()),     # index_q
            self.named(b, (), ()),        # index_k
            self.named(b, s, ()),         # weights
            self.named(b, ()),            # index_k_scale
            self.named(b),                # q_start
            self.named(b, s, ()),         # row_ranges
        )

    @property
    def out_shardings(self):
        return self.named(self.b, self.s, (), ())  # indices [B, S, 1, topk]


_OPERANDS = (("b", "s", "h", "d"), ("b", "n", "d"), ("b", "s", "h"), ("b", "n"), ("b",), ("b", "s", "r"))
_RESULTS = (("b", "s", "one", "k"),)
_REPLICATED = ("h", "d", "n", "r", "one", "k")


def indexer_topk_rule(*static_and_mesh_and_types):
    """index_q b s h d; index_k b n d; weights b s h; index_k_scale b n;
    q_start b; row_ranges b s r -> indices b s one k."""
    return sdy_rule(_OPERANDS, _RESULTS, _REPLICATED)


_PARAMS = ("topk", "scale", "causal", "k_stride", "implementation")
#: indexer_topk_p: (index_q, index_k, weights, index_k_scale, q_start,
#: row_ranges) -> indices.
PARTITIONING = OpPartitioning(6, _PARAMS, 4, 5, indexer_topk_rule, IndexerTopkDecision, False)
