"""How sparse_mla partitions over several devices (the driver is
``_core/partitioning.py``).

Besides B and S (every op), sparse_mla may shard the heads H of q, out and
lse: each head's softmax is independent of the others, so any split that
divides H evenly is exact, as long as the kv heads stay whole (HK = 1, the
MLA form; with HK > 1 the heads are gathered). ``kv`` is replicated within
a batch row (any query may select any key); ``indices``' T and the feature
dimensions stay whole (a softmax over a split T would need collectives).
"""

from __future__ import annotations

from ..._core.partitioning import Decision, OpPartitioning, read_spec, sdy_rule


class SparseMlaDecision(Decision):
    """sparse_mla: B, S and (with HK = 1) H from q; kv, T, D and d_v whole."""

    def __init__(self, mesh, shapes, shardings):
        super().__init__(mesh, shapes, shardings)
        H, HK = shapes[0][2], shapes[1][2]
        q_spec = read_spec(shardings[0], mesh, 4)
        self.h = self.take(q_spec[2], H) if HK == 1 else ()

    @property
    def arg_shardings(self):
        b, s, h = self.b, self.s, self.h
        return (
            self.named(b, s, h, ()),      # q
            self.named(b, (), (), ()),    # kv
            self.named(b, s, (), ()),     # indices
            self.named(b),                # q_start
            self.named(b, s, ()),         # row_ranges
        )

    @property
    def out_shardings(self):
        b, s, h = self.b, self.s, self.h
        return (self.named(b, s, h, ()), self.named(b, s, h))  # out [B, S, H, d_v], lse [B, S, H]


def sparse_mla_rule(*static_and_mesh_and_types):
    """sparse_mla: q b s h d; kv b n hk d; indices b s hk t; q_start b;
    row_ranges b s r -> out b s h v; lse b s h (h replicated when HK > 1)."""
    operand_types = static_and_mesh_and_types[-2]
    HK = tuple(operand_types[1].shape)[2]
    replicated = ["n", "hk", "d", "t", "r", "v"]
    if HK != 1:
        replicated.append("h")
    operands = (("b", "s", "h", "d"), ("b", "n", "hk", "d"), ("b", "s", "hk", "t"), ("b",), ("b", "s", "r"))
    return sdy_rule(operands, (("b", "s", "h", "v"), ("b", "s", "h")), replicated)


#: sparse_mla_p's operands (q, kv, indices, q_start, row_ranges) and static
#: parameters, in bind order.
PARAM_NAMES = ("sm_scale", "causal", "k_stride", "lse_base", "d_v", "deterministic", "implementation")
PARTITIONING = OpPartitioning(5, PARAM_NAMES, 3, 4, sparse_mla_rule, SparseMlaDecision, True)
