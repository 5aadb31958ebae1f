"""SPEC §6 (packed sequences, per-row top-k lengths) on the jnp path: against
the float64 oracle's independent evaluation of §6 (oracle.packed_valid_mask),
under jit with traced boundaries, indexer_loss, gradients, vmap, S-sharding
on 8 host devices and export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from grad_util import assert_grad_close, assert_grads_within_float32_bounds, plain_attn_dist
from inputs import make_indexer_inputs, seed_of
from jax_attn_dist import attn_dist, indexer_kl, indexer_loss, oracle
from packed_cases import (CASE_IDS, CASES, INDEXER_CASES, attn_problem, i32, indexer_problem, no_owner_rows,
                          traced_call)

F32 = jnp.float32


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_attn_dist_matches_float64(case):
    q, k, idx, lse, rule, pk = attn_problem(case)
    got = np.asarray(traced_call(attn_dist, (q, k, idx, lse), rule, pk))
    want = oracle.attn_dist_oracle(q, k, idx, lse, **rule, **pk)
    assert got.shape == want.shape
    if np.abs(want).max() == 0:
        assert np.all(got == 0)
    else:
        oracle.assert_within_spec(got, want)
    for s in no_owner_rows(case):
        assert np.all(got[:, s] == 0), f"row {s} belongs to no sequence but is not 0"
    # eager call (concrete boundaries) equals the traced one
    np.testing.assert_array_equal(attn_dist(q, k, idx, lse, **rule, **pk), got)
    # the masked set is neither empty nor everything (the case tests something)
    unpacked = oracle.valid_mask(np.asarray(idx)[None], case["N"], causal=False, q_start_index=0, k_stride=1)
    packed = oracle.valid_mask(np.asarray(idx)[None], case["N"], causal=rule["causal"],
                               q_start_index=np.asarray(rule["q_start_index"]), k_stride=rule["k_stride"],
                               **pk)
    if case["name"] not in ("no-sequences", "topk-alone-full", "bad-everything"):
        assert packed.any() and (unpacked & ~packed).any()


def test_oracle_rule_by_hand():
    """The oracle's reading of SPEC §6.2/§6.3 on small hand-checked cases."""
    # rows 3, 4 are claimed by sequences 0 and 2 (seq 1 decreases): ambiguous -> no owner
    assert oracle.packed_owner([0, 5, 3, 8], [0, 4, 4, 9], 10, 9) == [0, 0, 0, None, None, 2, 2, 2, None, None]
    # a sequence whose key range exceeds N: its rows only
    assert oracle.packed_owner([0, 2, 4], [0, 3, 11], 5, 10) == [0, 0, None, None, None]
    # a negative start: that sequence's rows (0 .. 1) give 0; the next one is fine
    assert oracle.packed_owner([-1, 2, 4], [0, 1, 3], 4, 3) == [None, None, 1, 1]
    idx = np.array([[[0, 1, 2, 3]], [[0, 1, 2, 3]], [[0, 1, 2, 3]]])
    v = oracle.packed_valid_mask(idx, 4, causal=True, q_start_index=[0, 5], k_stride=1, cu_seqlens_q=[0, 1, 3],
                                 cu_seqlens_k=[0, 1, 4])
    # row 0: seq 0, pos 0 sees key 0; rows 1, 2: seq 1 (keys 1..3) at pos 5, 6 see all of them
    np.testing.assert_array_equal(v[:, 0], [[1, 0, 0, 0], [0, 1, 1, 1], [0, 1, 1, 1]])
    v = oracle.packed_valid_mask(idx, 4, causal=True, q_start_index=0, k_stride=2, cu_seqlens_q=[0, 3],
                                 cu_seqlens_k=[1, 4])
    # k_stride 2: pos p sees i' <= floor((p - 1) / 2): pos 0 none, pos 1 i'=0 (key 1), pos 2 i'=0
    np.testing.assert_array_equal(v[:, 0], [[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0]])


@pytest.mark.parametrize("case", INDEXER_CASES, ids=[c["name"] for c in INDEXER_CASES])
def test_indexer_kl_matches_float64(case):
    iq, ik, w, idx, tgt, rule, pk = indexer_problem(case)
    got = np.asarray(traced_call(indexer_kl, (iq, ik, w, idx, tgt), rule, pk))
    want = oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **rule, **pk)
    oracle.assert_indexer_close(got, want)
    for s in no_owner_rows(case):
        assert got[s] == 0.0
    if case["name"] not in ("no-sequences", "bad-everything"):
        assert np.abs(want).max() > 0.01


@pytest.mark.parametrize("name", ["several", "k-stride-2", "topk-packed", "bad-decreasing-q", "topk-alone"])
def test_indexer_loss_equals_indexer_kl_on_the_packed_target(name):
    case = next(c for c in CASES if c["name"] == name)
    q, k, idx, lse, rule, pk = attn_problem(case, H=70)
    iq, ik, w, _, _, irule, _ = indexer_problem(case)
    got = traced_call(lambda *a, **kw: indexer_loss(*a[:6], idx, **kw), (q, k, lse, iq, ik, w),
                      dict(rule, scale=irule["scale"]), pk)

    def by_hand(q, k, lse, iq, ik, w):
        dist = attn_dist(q, k, idx, lse, **rule, **pk)
        mass = dist.sum(axis=-3)
        total = mass.sum(-1, keepdims=True)
        target = jnp.where(total > 0, mass / jnp.where(total > 0, total, 1), 0.0)
        return indexer_kl(iq, ik, w, idx, target, **irule, **pk)

    want = jax.jit(by_hand)(q, k, lse, iq, ik, w)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)  # two compilations: float32 rounding
    m64 = oracle.attn_dist_oracle(q, k, idx, lse, **rule, **pk).sum(axis=-3)
    t64 = m64 / np.where(m64.sum(-1, keepdims=True) > 0, m64.sum(-1, keepdims=True), 1)
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, t64, **irule, **pk))
    assert np.abs(np.asarray(got)).max() > 1e-3


def test_batched_topk_length_with_per_batch_q_start():
    B, S, N, T = 3, 9, 14, 7
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("packed-topk-batched"), B=B, S=S, HI=4, DI=16, N=N, T=T,
                                                  dtype=F32, q_start_index="batch")
    rng = np.random.default_rng(1)
    topk = jnp.asarray(rng.integers(-2, T + 3, (B, S)).astype(np.int32))
    got = jax.jit(lambda *a: indexer_kl(*a[:5], topk_length=a[5], **kw))(iq, ik, w, idx, tgt, topk)
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **kw, topk_length=topk))
    with pytest.raises(ValueError, match=r"indexer_kl: `topk_length` must have shape \[B, S\] = \[3, 9\]"):
        indexer_kl(iq, ik, w, idx, tgt, topk_length=topk[0], **kw)


# ----------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["several", "k-stride-2", "topk-packed", "bad-q-past-S", "topk-alone"])
def test_attn_dist_gradients_match_the_unpacked_call_on_masked_indices(name):
    """grad of the packed call = grad of plain jnp SPEC §2 (non-causal) on the
    indices the oracle's §6 rule leaves valid (others set to -1), both within
    the float32 rounding bound of the float64 gradients."""
    case = next(c for c in CASES if c["name"] == name)
    q, k, idx, lse, rule, pk = attn_problem(case)
    valid = oracle.valid_mask(np.asarray(idx)[None], case["N"], causal=rule["causal"],
                              q_start_index=np.asarray(rule["q_start_index"]), k_stride=rule["k_stride"],
                              **pk)[0]
    masked = jnp.asarray(np.where(valid, np.asarray(idx), -1).astype(np.int32))
    cot = jnp.asarray(np.random.default_rng(seed_of("packed-cot", name)).standard_normal((1, case["S"], case["T"])),
                      F32)
    plain_rule = dict(sm_scale=rule["sm_scale"], lse_base="e", causal=False)
    ours = jax.jit(jax.grad(lambda a, b, c: jnp.sum(cot * attn_dist(a, b, idx, c, **rule, **pk)), argnums=(0, 1, 2)))
    plain = jax.jit(jax.grad(lambda a, b, c: jnp.sum(cot * plain_attn_dist(a, b, masked, c, **plain_rule)),
                             argnums=(0, 1, 2)))
    assert_grads_within_float32_bounds(ours(q, k, lse), plain(q, k, lse), q, k, masked, lse, plain_rule, cot)


@pytest.mark.parametrize("name", ["several", "k-stride-2", "topk-packed", "bad-k-decreasing"])
def test_indexer_gradients_match_float64(name):
    case = next(c for c in CASES if c["name"] == name)
    iq, ik, w, idx, tgt, rule, pk = indexer_problem(case)
    g = jnp.asarray(np.random.default_rng(seed_of("packed-igrad", name)).standard_normal(case["S"]), F32)
    got = jax.jit(jax.grad(lambda a, b, c: jnp.sum(g * indexer_kl(a, b, c, idx, tgt, **rule, **pk)),
                           argnums=(0, 1, 2)))(iq, ik, w)
    want = oracle.indexer_grads_oracle(iq, ik, w, idx, tgt, g, **rule, **pk)
    for nm, a, o in zip(("d_index_q", "d_index_k", "d_weights"), got, want):
        assert_grad_close(a, o, nm, 2e-5, 2e-6)
    for s in no_owner_rows(case):
        assert np.all(np.asarray(got[0][s]) == 0) and np.all(np.asarray(got[2][s]) == 0)


# ----------------------------------------------------------------------------
# vmap
# ----------------------------------------------------------------------------


def test_vmap_gives_each_example_its_own_boundaries():
    S, N, T, V = 16, 18, 8, 3
    cus = [([0, 5, 11, 16], [0, 6, 12, 18]), ([0, 9, 9, 13], [0, 8, 8, 14]), ([0, 3, 12, 10], [0, 3, 9, 18])]
    probs = [indexer_problem(dict(name=f"vmap{v}", S=S, N=N, T=T, cu_q=cq, cu_k=ck, q_start=[v, 0, 2]))
             for v, (cq, ck) in enumerate(cus)]
    stack = [jnp.stack([p[i] for p in probs]) for i in range(5)]
    cq = jnp.stack([p[6]["cu_seqlens_q"] for p in probs])
    ck = jnp.stack([p[6]["cu_seqlens_k"] for p in probs])
    qs = jnp.stack([p[5]["q_start_index"] for p in probs])
    rule = {k: v for k, v in probs[0][5].items() if k != "q_start_index"}

    def f(a, b, c, d, e, s, u, x):
        return indexer_kl(a, b, c, d, e, q_start_index=s, cu_seqlens_q=u, cu_seqlens_k=x, **rule)

    got = np.asarray(jax.jit(jax.vmap(f))(*stack, qs, cq, ck))
    for v in range(V):
        one = jax.jit(f)(*(x[v] for x in stack), qs[v], cq[v], ck[v])
        np.testing.assert_allclose(got[v], one, rtol=1e-6, atol=1e-6)
        pkv = dict(cu_seqlens_q=np.asarray(cq[v]), cu_seqlens_k=np.asarray(ck[v]))
        oracle.assert_indexer_close(got[v], oracle.indexer_kl_oracle(*(x[v] for x in stack), **rule,
                                                                     q_start_index=np.asarray(qs[v]), **pkv))
    # gradients under vmap
    gv = jax.jit(jax.vmap(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))))(*stack, qs, cq, ck)
    one = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2)))
    for v in range(V):
        gl = one(*(x[v] for x in stack), qs[v], cq[v], ck[v])
        for a, b in zip(gv, gl):
            np.testing.assert_allclose(a[v], b, rtol=1e-5, atol=1e-6)


def test_vmap_attn_dist_equals_loop():
    base = dict(S=12, N=14, T=6)
    cus = [([0, 4, 12], [0, 5, 14], [1, 2]), ([0, 7, 9], [0, 7, 10], [0, 0])]
    probs = [attn_problem(dict(base, name=f"avmap{v}", cu_q=cq, cu_k=ck, q_start=qs))
             for v, (cq, ck, qs) in enumerate(cus)]
    rule = {k: v for k, v in probs[0][4].items() if k != "q_start_index"}
    stack = [jnp.stack([p[i] for p in probs]) for i in range(4)]
    qs = jnp.stack([p[4]["q_start_index"] for p in probs])
    cq = jnp.stack([p[5]["cu_seqlens_q"] for p in probs])
    ck = jnp.stack([p[5]["cu_seqlens_k"] for p in probs])
    f = lambda a, b, c, d, s, u, x: attn_dist(a, b, c, d, q_start_index=s, cu_seqlens_q=u,  # noqa: E731
                                              cu_seqlens_k=x, **rule)
    got = np.asarray(jax.jit(jax.vmap(f))(*stack, qs, cq, ck))
    for v in range(len(cus)):
        np.testing.assert_allclose(got[v], f(*(x[v] for x in stack), qs[v], cq[v], ck[v]), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# S-sharding on 8 host devices
# ----------------------------------------------------------------------------


@pytest.mark.host_devices(8)
@pytest.mark.parametrize("grad", [False, True])
def test_s_sharded_equals_unsharded(grad):
    case = dict(name="sharded", S=32, N=40, T=8, cu_q=[0, 7, 7, 19, 28], cu_k=[0, 9, 9, 24, 36],
                q_start=[0, 2, 1, 3], topk=list(range(-2, 30)))
    q, k, idx, lse, rule, pk = attn_problem(case)
    iq, ik, w, _, tgt, irule, _ = indexer_problem(case)
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("cpu")[:8])
    qs = rule.pop("q_start_index")
    irule = {k: v for k, v in irule.items() if k != "q_start_index"}

    def f(q, k, idx, lse, iq, ik, w, tgt, topk, cq, ck, qs):
        extra = dict(topk_length=topk, cu_seqlens_q=cq, cu_seqlens_k=ck, q_start_index=qs)
        if not grad:
            return (attn_dist(q, k, idx, lse, **rule, **extra), indexer_kl(iq, ik, w, idx, tgt, **irule, **extra))
        return (jax.grad(lambda a, b, c: jnp.sum(attn_dist(a, b, idx, c, **rule, **extra) ** 2),
                         argnums=(0, 1, 2))(q, k, lse),
                jax.grad(lambda a, b, c: jnp.sum(indexer_kl(a, b, c, idx, tgt, **irule, **extra) ** 2),
                         argnums=(0, 1, 2))(iq, ik, w))

    args = (q, k, idx, lse, iq, ik, w, tgt, pk["topk_length"], pk["cu_seqlens_q"], pk["cu_seqlens_k"], qs)
    specs = (P("sp"), P(), P("sp"), P("sp"), P("sp"), P(), P("sp"), P("sp"), P("sp"), P(), P(), P())
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    ref = jax.jit(f)(*args)
    put = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    out = jax.jit(f, in_shardings=shardings)(*put)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    if not grad:
        oracle.assert_within_spec(out[0], oracle.attn_dist_oracle(q, k, idx, lse, q_start_index=np.asarray(qs),
                                                                  **rule, **pk))


# ----------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------


def test_export_takes_the_boundaries_as_inputs():
    """One exported function serves any boundary values (they are operands,
    not constants)."""
    from jax import export

    case = dict(name="export", S=16, N=20, T=8, cu_q=[0, 7, 14], cu_k=[0, 9, 18], q_start=[0, 2])
    q, k, idx, lse, rule, pk = attn_problem(case)
    rule = {k_: v for k_, v in rule.items() if k_ != "q_start_index"}
    f = jax.jit(lambda q, k, i, l, cq, ck, s: attn_dist(q, k, i, l, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                                        q_start_index=s, **rule))
    qs = jnp.asarray([0, 2], jnp.int32)
    exp = export.export(f, platforms=["cpu"])(q, k, idx, lse, pk["cu_seqlens_q"], pk["cu_seqlens_k"], qs)
    for cq, ck in (([0, 7, 14], [0, 9, 18]), ([0, 3, 16], [0, 4, 20]), ([0, 9, 4], [0, 9, 18])):
        cq, ck = i32(cq), i32(ck)
        np.testing.assert_array_equal(exp.call(q, k, idx, lse, cq, ck, qs), f(q, k, idx, lse, cq, ck, qs))
        oracle.assert_within_spec(exp.call(q, k, idx, lse, cq, ck, qs), oracle.attn_dist_oracle(
            q, k, idx, lse, q_start_index=np.asarray(qs), cu_seqlens_q=np.asarray(cq), cu_seqlens_k=np.asarray(ck),
            **rule))
