"""SPEC §6 (packed sequences, per-row top-k lengths) on the jnp path: against
the float64 oracle's independent evaluation of §6 (oracle.packed_valid_mask),
under jit with traced boundaries, vmap, S-sharding on 8 host devices,
gradients, cu_seqlens_from_segment_ids, and bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from grad_util import assert_grad_close, plain_attn_dist
from inputs import INT32_MAX, INT32_MIN, make_indexer_inputs, seed_of
from jax_attn_dist import attn_dist, cu_seqlens_from_segment_ids, indexer_kl, indexer_loss, oracle
from jax_attn_dist._core import chunks, packing
from jax_attn_dist.ops.indexer import contract as indexer_contract

BF16, F32 = jnp.bfloat16, jnp.float32
BAD_POOL = np.array([INT32_MIN, -1, -7, INT32_MAX], np.int64)


# ----------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------


def packed_indices(rng, *, S, N, HK, T, cu_q, cu_k, q_start, k_stride, causal, bad_fraction=0.2,
                   other_fraction=0.2):
    """int32 [S, HK, T]: most slots inside the row's own sequence and (when
    causal) visible to it, some in other sequences or not yet visible, some
    out of range; rows of no sequence get random keys. The row's sequence is
    found with the oracle's reading of SPEC §6 (as a generator only)."""
    owner = oracle.packed_owner(cu_q, cu_k, S, N)
    cu_q = np.asarray(cu_q, np.int64)
    cu_k = np.asarray(cu_k, np.int64)
    starts = np.broadcast_to(np.asarray(q_start, np.int64), (len(cu_q) - 1,))
    idx = rng.integers(0, N, (S, HK, T)).astype(np.int64)
    for s, b in enumerate(owner):
        if b is None:
            continue
        hi = cu_k[b + 1]
        if causal:
            pos = s - cu_q[b] + starts[b]
            hi = min(hi, cu_k[b] + (pos + 1 - k_stride) // k_stride + 1)
        if hi > cu_k[b]:
            own = rng.integers(cu_k[b], hi, (HK, T))
            idx[s] = np.where(rng.random((HK, T)) < other_fraction, idx[s], own)
    bad = BAD_POOL[rng.integers(0, len(BAD_POOL), idx.shape)]
    idx = np.where(rng.random(idx.shape) < bad_fraction, bad, idx)
    return jnp.asarray(idx.astype(np.int32))


def i32(x):
    return None if x is None else jnp.asarray(np.asarray(x, np.int64).astype(np.int32))


def packing_kwargs(case):
    kw = dict(cu_seqlens_q=i32(case.get("cu_q")), cu_seqlens_k=i32(case.get("cu_k")),
              topk_length=i32(case.get("topk")))
    return {k: v for k, v in kw.items() if v is not None}


def case_indices(rng, case, HK=1):
    """The case's slot indices [S, HK, T]: a packed layout's, or any values
    around [0, N) for topk_length alone."""
    S, N, T = case["S"], case["N"], case["T"]
    if "cu_q" not in case:
        return jnp.asarray(rng.integers(-2, N + 2, (S, HK, T)).astype(np.int32))
    return packed_indices(rng, S=S, N=N, HK=HK, T=T, cu_q=case["cu_q"], cu_k=case["cu_k"],
                          q_start=case.get("q_start", 0), k_stride=case.get("k_stride", 1),
                          causal=case.get("causal", True))


def case_q_start(case):
    qs = case.get("q_start", 0)
    return qs if isinstance(qs, int) else i32(qs)


def attn_problem(case, *, H=6, D=16, dtype=F32):
    """(q, k, indices, lse, rule kwargs, §6 kwargs) for an unbatched packed case."""
    rng = np.random.default_rng(seed_of("packed-attn", case["name"]))
    S, N, HK = case["S"], case["N"], case.get("HK", 1)
    q = jnp.asarray(rng.standard_normal((S, H, D)).astype(np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((N, HK, D)).astype(np.float32), dtype)
    idx = case_indices(rng, case, HK)
    rule = dict(sm_scale=float(D ** -0.5), causal=case.get("causal", True), q_start_index=case_q_start(case),
                k_stride=case.get("k_stride", 1), lse_base="e")
    pk = packing_kwargs(case)
    # exact lse over the §6 valid set; a finite 0 where a row has none, so
    # that a row which §6 empties would show up if it were not masked
    lse = oracle.exact_lse(q, k, idx, **rule, empty_value=0.0, **pk)
    return q, k, idx, jnp.asarray(lse.astype(np.float32)), rule, pk


CASES = [
    # several sequences, one empty, padding rows (>= 20) and padding keys (>= 26), per-sequence q_start
    dict(name="several", S=24, N=30, T=10, cu_q=[0, 5, 5, 12, 20], cu_k=[0, 6, 6, 15, 26],
         q_start=[0, 3, -2, 4]),
    dict(name="several-int-start", S=24, N=30, T=10, cu_q=[0, 5, 5, 12, 20], cu_k=[0, 6, 6, 15, 26], q_start=1),
    dict(name="gqa-hk2", S=16, N=20, T=8, HK=2, cu_q=[0, 7, 16], cu_k=[0, 9, 20], q_start=[0, 2]),
    dict(name="not-causal", S=16, N=20, T=8, causal=False, cu_q=[0, 6, 13], cu_k=[0, 8, 17]),
    # compressed keys: sequence b's keys cu_k[b] .. are every 2nd position
    dict(name="k-stride-2", S=20, N=12, T=8, k_stride=2, cu_q=[0, 8, 14, 20], cu_k=[0, 4, 7, 10],
         q_start=[0, 1, 3]),
    dict(name="k-stride-3-big-start", S=18, N=14, T=8, k_stride=3, cu_q=[0, 9, 18], cu_k=[0, 7, 14],
         q_start=[INT32_MAX - 4, INT32_MIN]),
    dict(name="rows-before-first", S=16, N=16, T=8, cu_q=[3, 9, 14], cu_k=[2, 9, 16]),
    dict(name="no-sequences", S=8, N=8, T=6, cu_q=[0], cu_k=[0]),
    # topk_length: < 0, 0, partial, T, > T per row, with and without packing
    dict(name="topk-packed", S=16, N=20, T=8, cu_q=[0, 7, 14], cu_k=[0, 9, 18],
         topk=[-3, 0, 1, 4, 8, 9, INT32_MAX, INT32_MIN, 2, 3, 5, 7, 6, 8, 100, 1]),
    dict(name="topk-alone", S=10, N=12, T=6, q_start=2, topk=[-1, 0, 1, 3, 6, 7, 2, 5, INT32_MIN, INT32_MAX]),
    dict(name="topk-alone-full", S=10, N=12, T=6, causal=False, topk=[6] * 10),
    # malformed boundaries: no error, the rows they touch give 0
    dict(name="bad-decreasing-q", S=20, N=24, T=8, cu_q=[0, 8, 6, 14, 20], cu_k=[0, 6, 12, 18, 24]),
    dict(name="bad-negative-q", S=20, N=24, T=8, cu_q=[-2, 6, 14, 20], cu_k=[0, 6, 12, 24]),
    dict(name="bad-q-past-S", S=20, N=24, T=8, cu_q=[0, 8, 14, 25], cu_k=[0, 6, 12, 24]),
    dict(name="bad-q-just-past-S", S=20, N=24, T=8, cu_q=[0, 8, 14, 21], cu_k=[0, 6, 12, 24]),
    dict(name="bad-k-just-past-N", S=20, N=24, T=8, cu_q=[0, 8, 14, 20], cu_k=[0, 6, 12, 25]),
    dict(name="bad-k-past-N", S=20, N=24, T=8, cu_q=[0, 8, 14, 20], cu_k=[0, 6, 12, 30]),
    dict(name="bad-k-decreasing", S=20, N=24, T=8, cu_q=[0, 8, 14, 20], cu_k=[0, 12, 6, 24]),
    dict(name="bad-k-negative", S=20, N=24, T=8, cu_q=[0, 8, 14, 20], cu_k=[-4, 6, 12, 24]),
    dict(name="bad-extremes", S=12, N=12, T=6, cu_q=[INT32_MIN, 4, 8, 12], cu_k=[0, 4, 8, INT32_MIN]),
    dict(name="bad-everything", S=12, N=12, T=6, cu_q=[INT32_MIN, 4, INT32_MAX, 12], cu_k=[0, 4, 8, INT32_MIN]),
]
CASE_IDS = [c["name"] for c in CASES]


def traced_call(fn, arrays, rule, pk):
    """``fn(*arrays, **rule, **pk)`` under jit, q_start_index and every §6
    array traced."""
    rule = dict(rule)
    qs = rule.pop("q_start_index")
    names = sorted(pk)

    @jax.jit
    def f(arrays, qs, pk_vals):
        return fn(*arrays, q_start_index=qs, **rule, **dict(zip(names, pk_vals)))

    qs = jnp.asarray(qs, jnp.int32) if isinstance(qs, int) else qs
    return f(tuple(arrays), qs, tuple(pk[n] for n in names))


def no_owner_rows(case):
    if "cu_q" not in case:
        return []
    return [s for s, b in enumerate(oracle.packed_owner(case["cu_q"], case["cu_k"], case["S"], case["N"]))
            if b is None]


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


INDEXER_CASES = [c for c in CASES if c.get("HK", 1) == 1]


def indexer_problem(case, *, dtype=F32, HI=4, DI=16):
    S, N, T = case["S"], case["N"], case["T"]
    seed = seed_of("packed-indexer", case["name"])
    iq, ik, w, _, tgt, kw = make_indexer_inputs(seed, S=S, HI=HI, DI=DI, N=N, T=T, dtype=dtype, zero_rows=0.1)
    idx = case_indices(np.random.default_rng(seed), case)
    rule = dict(scale=kw["scale"], causal=case.get("causal", True), q_start_index=case_q_start(case),
                k_stride=case.get("k_stride", 1))
    return iq, ik, w, idx, tgt, rule, packing_kwargs(case)


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
    dist = attn_dist(q, k, idx, lse, **rule, **pk)
    mass = dist.sum(axis=-3)
    total = mass.sum(-1, keepdims=True)
    target = jnp.where(total > 0, mass / jnp.where(total > 0, total, 1), 0.0)
    want = indexer_kl(iq, ik, w, idx, target, **irule, **pk)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)  # jitted vs eager target: float32 rounding
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
    indices the oracle's §6 rule leaves valid (others set to -1)."""
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
    plain = jax.grad(lambda a, b, c: jnp.sum(cot * plain_attn_dist(a, b, masked, c, **plain_rule)), argnums=(0, 1, 2))
    for nm, a, b in zip(("dq", "dk", "dlse"), ours(q, k, lse), plain(q, k, lse)):
        assert_grad_close(a, b, nm, 1e-5, 1e-6)


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
        one = f(*(x[v] for x in stack), qs[v], cq[v], ck[v])
        np.testing.assert_allclose(got[v], one, rtol=1e-6, atol=1e-6)
        pkv = dict(cu_seqlens_q=np.asarray(cq[v]), cu_seqlens_k=np.asarray(ck[v]))
        oracle.assert_indexer_close(got[v], oracle.indexer_kl_oracle(*(x[v] for x in stack), **rule,
                                                                     q_start_index=np.asarray(qs[v]), **pkv))
    # gradients under vmap
    gv = jax.jit(jax.vmap(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))))(*stack, qs, cq, ck)
    for v in range(V):
        gl = jax.grad(lambda *a: f(*a, stack[3][v], stack[4][v], qs[v], cq[v], ck[v]).sum(), argnums=(0, 1, 2))(
            stack[0][v], stack[1][v], stack[2][v])
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
# cu_seqlens_from_segment_ids
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("ids,num_seqs,want", [
    ([0, 0, 0, 1, 1, 2, 2, 2, 2], 3, [0, 3, 5, 9]),
    ([0, 0, 1, 1, 1, -1, -1], 2, [0, 2, 5]),                 # padding at the end
    ([0, 0, 1, 1, 1, -1, -1], 5, [0, 2, 5, 5, 5, 5]),        # more sequences than present: empty ones
    ([0, 0, 2, 2, -1], 4, [0, 2, 2, 4, 4]),                  # sequence 1 absent: empty
    ([-1, -1, -1], 2, [0, 0, 0]),                            # all padding
    ([0, 1, 2, 3], 2, [0, 1, 2]),                            # ids >= num_seqs count as padding
    ([], 3, [0, 0, 0, 0]),
    ([0, 0, 1], 0, [0]),
])
def test_cu_seqlens_from_segment_ids(ids, num_seqs, want):
    got = cu_seqlens_from_segment_ids(jnp.asarray(ids, jnp.int32), num_seqs)
    assert got.dtype == jnp.int32 and got.shape == (num_seqs + 1,)
    np.testing.assert_array_equal(got, want)
    jitted = jax.jit(cu_seqlens_from_segment_ids, static_argnums=1)(jnp.asarray(ids, jnp.int32), num_seqs)
    np.testing.assert_array_equal(jitted, want)


def test_cu_seqlens_from_segment_ids_batched_and_in_use():
    ids = jnp.asarray([[0, 0, 1, 1, 1, -1], [0, 1, 1, 1, 1, 1]], jnp.int32)
    cu = cu_seqlens_from_segment_ids(ids, 3)
    np.testing.assert_array_equal(cu, [[0, 2, 5, 5], [0, 1, 6, 6]])
    np.testing.assert_array_equal(jax.vmap(lambda r: cu_seqlens_from_segment_ids(r, 3))(ids), cu)
    # with q and k sharing the packed layout: a padding row gives 0, and
    # no row sees a key of another sequence
    S = 6
    q, k, idx, lse, rule, _ = attn_problem(dict(name="segment-use", S=S, N=S, T=S, causal=False))
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (S, 1, S))
    out = np.asarray(attn_dist(q, k, idx, lse, **dict(rule, causal=True), cu_seqlens_q=cu[0], cu_seqlens_k=cu[0]))
    seq = np.asarray(ids[0])
    allowed = (seq[:, None] == seq[None, :]) & (seq[:, None] >= 0) & (np.arange(S)[None] <= np.arange(S)[:, None])
    assert np.all(out[0][~allowed] == 0) and np.all(out[0][allowed] > 0)


@pytest.mark.parametrize("args,exc,msg", [
    ((jnp.zeros((4,), F32), 2), TypeError, "`segment_ids` must have an integer dtype"),
    ((jnp.zeros((2, 2, 2), jnp.int32), 2), ValueError, "`segment_ids` must have rank 1"),
    ((jnp.zeros((4,), jnp.int32), -1), ValueError, "`num_seqs` must be an int >= 0"),
    ((jnp.zeros((4,), jnp.int32), 2.0), TypeError, "`num_seqs` must be a Python int"),
    (([0, 1], 2), TypeError, "`segment_ids` must be an int32 array"),
])
def test_cu_seqlens_from_segment_ids_bad_inputs(args, exc, msg):
    with pytest.raises(exc, match="cu_seqlens_from_segment_ids: " + msg):
        cu_seqlens_from_segment_ids(*args)


# ----------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------


def _attn_args(batched=False):
    lead = (2,) if batched else ()
    return (jnp.zeros(lead + (5, 2, 16), F32), jnp.zeros(lead + (7, 1, 16), F32),
            jnp.zeros(lead + (5, 1, 3), jnp.int32), jnp.zeros(lead + (5, 2), F32))


CU = jnp.asarray([0, 2, 5], jnp.int32)
BAD = [
    ("only q", dict(cu_seqlens_q=CU), ValueError, "`cu_seqlens_q` was given without `cu_seqlens_k`"),
    ("only k", dict(cu_seqlens_k=CU), ValueError, "`cu_seqlens_k` was given without `cu_seqlens_q`"),
    ("cu rank", dict(cu_seqlens_q=CU[None], cu_seqlens_k=CU[None]), ValueError,
     r"`cu_seqlens_q` must have shape \[num_seqs \+ 1\]"),
    ("cu empty", dict(cu_seqlens_q=CU[:0], cu_seqlens_k=CU[:0]), ValueError,
     r"`cu_seqlens_q` must have shape \[num_seqs \+ 1\]"),
    ("cu lengths", dict(cu_seqlens_q=CU, cu_seqlens_k=CU[:2]), ValueError,
     "`cu_seqlens_q` and `cu_seqlens_k` must have the same shape"),
    ("cu dtype", dict(cu_seqlens_q=CU.astype(F32), cu_seqlens_k=CU), TypeError,
     "`cu_seqlens_q` must have an integer dtype"),
    ("cu list", dict(cu_seqlens_q=[0, 2, 5], cu_seqlens_k=CU), TypeError, "`cu_seqlens_q` must be an int32 array"),
    ("cu too wide", dict(cu_seqlens_q=np.array([0, 2**33, 5]), cu_seqlens_k=CU), ValueError,
     "`cu_seqlens_q` must fit in int32"),
    ("q_start shape", dict(cu_seqlens_q=CU, cu_seqlens_k=CU, q_start_index=jnp.zeros((3,), jnp.int32)), ValueError,
     r"with cu_seqlens, `q_start_index` must be a Python int or an array of shape \[\] or \[num_seqs\] = \[2\]"),
    ("q_start big", dict(cu_seqlens_q=CU, cu_seqlens_k=CU, q_start_index=2**31), ValueError,
     "`q_start_index` must fit in int32"),
    ("q_start float", dict(cu_seqlens_q=CU, cu_seqlens_k=CU, q_start_index=jnp.zeros((2,), F32)), TypeError,
     "`q_start_index` must have an integer dtype"),
    ("q_start per seq without cu", dict(q_start_index=jnp.zeros((2,), jnp.int32)), ValueError,
     "`q_start_index` must be a scalar"),
    ("topk shape", dict(topk_length=jnp.zeros((4,), jnp.int32)), ValueError,
     r"`topk_length` must have shape \[S\] = \[5\]"),
    ("topk dtype", dict(topk_length=jnp.zeros((5,), F32)), TypeError, "`topk_length` must have an integer dtype"),
    ("topk bool", dict(topk_length=True), TypeError, "`topk_length` must be an int32 array"),
]


@pytest.mark.parametrize("name,kw,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, kw, exc, msg):
    with pytest.raises(exc, match="attn_dist: " + msg):
        attn_dist(*_attn_args(), sm_scale=0.1, lse_base="e", **kw)
    q, k, idx, lse = _attn_args()
    iq, ik, w, tgt = q, k[:, 0], lse, jnp.zeros((5, 3), F32)
    with pytest.raises(exc, match="indexer_kl: " + msg):
        indexer_kl(iq, ik, w, idx, tgt, **kw)
    with pytest.raises(exc, match="indexer_loss: " + msg):
        indexer_loss(q, k, lse, iq, ik, w, idx, sm_scale=0.1, lse_base="e", **kw)


def test_cu_seqlens_need_unbatched_inputs():
    with pytest.raises(ValueError, match="attn_dist: `cu_seqlens_q`/`cu_seqlens_k` are accepted only with unbatched"):
        attn_dist(*_attn_args(batched=True), lse_base="2", sm_scale=0.1, cu_seqlens_q=CU, cu_seqlens_k=CU)


def test_traced_wide_cu_seqlens_rejected():
    with jax.enable_x64(True), pytest.raises(TypeError, match="a traced `cu_seqlens_q` must be int32"):
        jax.jit(lambda c: attn_dist(*_attn_args(), lse_base="2", sm_scale=0.1, cu_seqlens_q=c, cu_seqlens_k=CU))(
            CU.astype(jnp.int64))


def test_empty_problem_with_packing():
    q, k, idx, lse = (x[:0] for x in _attn_args())
    out = attn_dist(q, k, idx[:, :, :], lse, lse_base="2", sm_scale=0.1, cu_seqlens_q=CU, cu_seqlens_k=CU,
                    q_start_index=jnp.zeros((2,), jnp.int32))
    assert out.shape == (1, 0, 3)
    q, k, idx, lse = _attn_args()
    out = indexer_loss(q, k, lse, q, k[:, 0], lse, idx[..., :0], lse_base="2", sm_scale=0.1, cu_seqlens_q=CU, cu_seqlens_k=CU,
                       q_start_index=jnp.zeros((2,), jnp.int32), topk_length=jnp.zeros((5,), jnp.int32))
    assert out.shape == (5,) and np.all(np.asarray(out) == 0)


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


# ----------------------------------------------------------------------------
# the per-row ranges the primitives take, against the oracle's reading
# ----------------------------------------------------------------------------


def _every_key(S, N, lead=()):
    """indices selecting every key and a few invalid ones, in every row:
    [*lead, S, 1, N + 4] (slot j holds key j - 2)."""
    return np.broadcast_to(np.arange(-2, N + 2, dtype=np.int32), lead + (S, 1, N + 4))


@pytest.mark.parametrize("fused", [True, False], ids=["fused-claims", "difference-arrays"])
@pytest.mark.parametrize("seed", range(8))
def test_row_ranges_match_oracle_on_random_boundaries(seed, fused, monkeypatch):
    """packing.row_ranges + chunks.in_row_ranges (the rule every path
    applies; the claimers found either way) equal the oracle's SPEC §6
    validity slot by slot, on random
    boundaries (odd seeds malformed: decreasing, negative, past S or N,
    int32 extremes), random per-sequence starts (extremes included),
    k_stride 1..3, causal or not, and random topk_length."""

    monkeypatch.setattr(packing, "FUSED_CLAIMS", 1 << 30 if fused else 0)  # both ways to find the claimers
    rng = np.random.default_rng(seed_of("row-ranges-random", seed))
    S, N = 37, 45
    idx = _every_key(S, N)
    T = idx.shape[-1]
    num_seqs = int(rng.integers(0, 7))
    cu_q = np.sort(rng.integers(0, S + 1, num_seqs + 1))
    cu_k = np.sort(rng.integers(0, N + 1, num_seqs + 1))
    if seed % 2:
        pool = np.array([INT32_MIN, -3, -1, S - 1, S + 1, N + 1, INT32_MAX])
        for cu in (cu_q, cu_k):
            hit = rng.random(cu.shape) < 0.3
            cu[hit] = pool[rng.integers(0, len(pool), hit.sum())]
            if rng.random() < 0.5 and len(cu) > 2:
                cu[1], cu[2] = cu[2] + 3, cu[1]  # a decreasing pair
    q_start = rng.integers(-60, 60, num_seqs)
    if num_seqs and rng.random() < 0.5:
        q_start[0] = INT32_MAX if seed % 4 < 2 else INT32_MIN
    topk = rng.integers(-3, T + 3, S)
    topk[: len(topk) // 4] = rng.choice([INT32_MIN, INT32_MAX, 0, T], len(topk) // 4)
    for causal in (True, False):
        for ks in (1, 2, 3):
            pk = dict(topk_length=i32(topk), cu_seqlens_q=i32(cu_q), cu_seqlens_k=i32(cu_k))
            packed = packing.Packing(q_start_index=i32(q_start), **pk)
            ranges = packing.row_ranges(packed, S=S, N=N, T=T, causal=causal, k_stride=ks)
            got = np.asarray(chunks.in_row_ranges(jnp.asarray(idx), ranges, N=N))
            want = oracle.valid_mask(idx[None], N, causal=causal, q_start_index=q_start, k_stride=ks,
                                     **pk)[0]
            np.testing.assert_array_equal(got, want, err_msg=f"causal={causal} k_stride={ks}")


@pytest.mark.parametrize("q_start", ["batch-extremes", 5])
def test_row_ranges_topk_alone_batched(q_start):
    """topk_length alone (batched, per-batch q_start with int32 extremes): the
    ranges hold the causal rule too."""

    rng = np.random.default_rng(seed_of("row-ranges-topk", str(q_start)))
    B, S, N = 3, 21, 30
    idx = _every_key(S, N, (B,))
    T = idx.shape[-1]
    qs = np.array([INT32_MIN, -4, INT32_MAX - 3]) if q_start == "batch-extremes" else q_start
    topk = rng.integers(-3, T + 3, (B, S))
    for causal in (True, False):
        for ks in (1, 2, 4):
            packed = packing.Packing(topk_length=i32(topk), q_start_index=qs if isinstance(qs, int) else i32(qs))
            ranges = packing.row_ranges(packed, S=S, N=N, T=T, causal=causal, k_stride=ks, batch=B)
            got = np.asarray(chunks.in_row_ranges(jnp.asarray(idx).reshape(B * S, 1, T),
                                                   ranges.reshape(B * S, 3), N=N)).reshape(idx.shape)
            want = oracle.valid_mask(idx, N, causal=causal, q_start_index=qs, k_stride=ks, topk_length=topk)
            np.testing.assert_array_equal(got, want, err_msg=f"causal={causal} k_stride={ks}")


def test_cuda_lowering_passes_row_ranges_to_the_kernels(cross_lowering):
    """On CUDA, a packed call hands its per-row ranges [1, S, 3] to the
    kernels' custom calls (forward and backward); the indices reach them
    unmasked (no [S, T] select before the call)."""

    case = dict(name="lowering", S=16, N=20, T=8, cu_q=[0, 7, 14], cu_k=[0, 9, 18], topk=[3] * 16)
    iq, ik, w, idx, tgt, rule, pk = indexer_problem(case, dtype=BF16, HI=16, DI=64)
    fn = lambda a, b, c: jnp.sum(indexer_kl(a, b, c, idx, tgt, **rule, **pk))  # noqa: E731
    text = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).trace(iq, ik, w).lower(lowering_platforms=("cuda",)).as_text()
    for target in (indexer_contract.FWD_FFI_TARGET, indexer_contract.BWD_FFI_TARGET):
        call = text[text.index(f"stablehlo.custom_call @{target}("):]
        call = call[:call.index("\n")]
        assert "tensor<1x16x3xi32>" in call, call
    assert "tensor<1x16x1x8xi1>" not in text and "tensor<16x1x8xi1>" not in text  # no [S, T] mask
