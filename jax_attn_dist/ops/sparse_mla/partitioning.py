"""How sparse_mla partitions over several devices (the driver is
``_core/partitioning.py``).

Besides B and S (every op), sparse_mla may shard the heads H of q, out and
lse: each head's softmax is independent of the others, so any split that
divides H evenly is exact, as long as the kv heads stay whole (HK = 1, the
MLA form; with HK > 1 the heads are gathered). ``kv`` is replicated within
a batch row (any query may select any key); ``indices``' T and the feature
dimensions stay whole (a softmax over a split T would need collectives).

The backward shards like the forward (out, lse and the cotangents with their
rows and heads). Its ``dkv`` sums over every row and every head: each S- and
H-shard computes the partial sum of its rows and heads, and ``finish``
``psum``s it over the S and H axes. With ``deterministic`` on the kernel,
``run`` instead has the shards agree on one fixed-point scale and add their
integer sums exactly (``sharded_fixed_point.py``): an S-sharded call gives
the unsharded call's bits.
"""

from __future__ import annotations

import jax

from ..._core import fixed_point
from ..._core.partitioning import Decision, OpPartitioning, mesh_size, read_spec, sdy_rule
from . import sharded_fixed_point


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


class SparseMlaBwdDecision(SparseMlaDecision):
    """sparse_mla backward: as the forward, plus out, lse, dout and dlse with
    their rows and heads; dkv sums over rows and heads, so each S- and
    H-shard's partial sum is psum'ed."""

    @property
    def arg_shardings(self):
        b, s, h = self.b, self.s, self.h
        values, heads = self.named(b, s, h, ()), self.named(b, s, h)
        return super().arg_shardings + (values, heads, values, heads)  # out, lse, dout, dlse

    @property
    def out_shardings(self):
        b, s, h = self.b, self.s, self.h
        return (self.named(b, s, h, ()), self.named(b, (), (), ()))  # dq [B, S, H, D], dkv [B, N, HK, D]

    def finish(self, outs):
        dq, dkv = outs
        partial_axes = self.s + self.h
        if partial_axes:
            dkv = jax.lax.psum(dkv, partial_axes)
        return dq, dkv

    def run(self, bind, operands, params):
        """With ``deterministic`` on the CUDA kernel, the shards first agree
        on each batch element's fixed-point scale and then add their exact
        integer sums (``sharded_fixed_point.py``)."""
        partial_axes = self.s + self.h
        if not (params["deterministic"] and partial_axes
                and sharded_fixed_point.kernel_serves(operands, params, self.mesh)):
            return super().run(bind, operands, params)
        rows = operands[0].shape[1] * mesh_size(self.mesh, self.s) * mesh_size(self.mesh, self.h)
        fixed_point.check_shard_count(mesh_size(self.mesh, partial_axes), "sparse_mla backward", rows)
        return sharded_fixed_point.sharded_deterministic_backward(operands, params, axes=partial_axes,
                                                                  scale_rows=rows)


_OPERANDS = (("b", "s", "h", "d"), ("b", "n", "hk", "d"), ("b", "s", "hk", "t"), ("b",), ("b", "s", "r"))


def _replicated(static_and_mesh_and_types):
    """The factors kept whole: h too when HK > 1 (heads gathered)."""
    operand_types = static_and_mesh_and_types[-2]
    HK = tuple(operand_types[1].shape)[2]
    return ["n", "hk", "d", "t", "r", "v"] + (["h"] if HK != 1 else [])


def sparse_mla_rule(*static_and_mesh_and_types):
    """sparse_mla: q b s h d; kv b n hk d; indices b s hk t; q_start b;
    row_ranges b s r -> out b s h v; lse b s h (h replicated when HK > 1)."""
    return sdy_rule(_OPERANDS, (("b", "s", "h", "v"), ("b", "s", "h")), _replicated(static_and_mesh_and_types))


def sparse_mla_bwd_rule(*static_and_mesh_and_types):
    """sparse_mla backward: the forward's operands, out b s h v, lse b s h,
    dout b s h v, dlse b s h -> dq b s h d, dkv b n hk d."""
    operands = _OPERANDS + (("b", "s", "h", "v"), ("b", "s", "h"), ("b", "s", "h", "v"), ("b", "s", "h"))
    results = (("b", "s", "h", "d"), ("b", "n", "hk", "d"))
    return sdy_rule(operands, results, _replicated(static_and_mesh_and_types))


#: The static parameters of both primitives, in bind order. sparse_mla_p:
#: (q, kv, indices, q_start, row_ranges) -> (out, lse); sparse_mla_bwd_p:
#: the same plus (out, lse, dout, dlse) -> (dq, dkv).
PARAM_NAMES = ("sm_scale", "causal", "k_stride", "lse_base", "d_v", "deterministic", "implementation")
PARTITIONING = OpPartitioning(5, PARAM_NAMES, 3, 4, sparse_mla_rule, SparseMlaDecision, True)
BWD_PARTITIONING = OpPartitioning(9, PARAM_NAMES, 3, 4, sparse_mla_bwd_rule, SparseMlaBwdDecision, True)
