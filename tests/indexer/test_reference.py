"""indexer_kl on the jnp path (any backend) against the float64 oracle
(SPEC §5): a matrix of head counts, dims, dtypes, batch, causal rule and
q_start kinds; rows that must be exactly 0; large logits; the chunk loop;
empty problems; indexer_loss on attn_dist's target, whose sums run in one
fixed order."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import INT32_MAX, INT32_MIN, make_indexer_inputs, seed_of
from jax_attn_dist import attn_dist, indexer_kl, indexer_kl_reference, indexer_loss, oracle, synthetic
from jax_attn_dist._core import checks
from jax_attn_dist.ops.indexer.reference import indexer_reference_canonical, sum_in_fixed_order, target_from_dist

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def run(fn, iq, ik, w, idx, tgt, kw, **extra):
    """``fn`` under jit with q_start_index traced."""
    kw = dict(kw, **extra)
    qs = kw.pop("q_start_index")
    return jax.jit(lambda a, b, c, d, e, s: fn(a, b, c, d, e, q_start_index=s, **kw))(
        iq, ik, w, idx, tgt, jnp.asarray(qs, jnp.int32))


# A matrix crossing HI, DI, dtype, batch, causal, k_stride, q_start kinds.


_CASES = []
for n, (HI, DI) in enumerate(itertools.product((1, 16, 64, 5), (64, 128, 16))):
    dtype = (BF16, F16, F32)[n % 3]
    wdt = (F32, BF16)[n % 2]
    B = (None, 2, 3)[n % 3]
    causal = n % 4 != 3
    ks = (1, 2, 4)[n % 3]
    qs = "batch" if B and n % 2 else None
    _CASES.append(dict(HI=HI, DI=DI, dtype=dtype, weights_dtype=wdt, B=B, causal=causal, k_stride=ks, q_start_index=qs))


def _cid(c):
    return "HI{HI}-DI{DI}-{dt}-w{wdt}-B{B}-{c}-ks{k_stride}-{qs}".format(
        dt=jnp.dtype(c["dtype"]).name, wdt=jnp.dtype(c["weights_dtype"]).name, c="causal" if c["causal"] else "full",
        qs=c["q_start_index"] or "int", **{k: v for k, v in c.items() if k in ("HI", "DI", "B", "k_stride")})


@pytest.mark.parametrize("case", _CASES, ids=[_cid(c) for c in _CASES])
def test_matches_float64(case):
    seed = seed_of("indexer", _cid(case))
    S, N, T = 19, 37, 24
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed, S=S, N=N, T=T, **case)
    got = np.asarray(run(indexer_kl, iq, ik, w, idx, tgt, kw))
    want = oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **kw)
    lead = (case["B"],) if case["B"] else ()
    assert got.shape == lead + (S,) and got.dtype == np.float32
    oracle.assert_indexer_close(got, want)
    assert np.abs(want).max() > 0.01  # not a degenerate case
    # the reference entry point agrees (same code path, other front door)
    ref = np.asarray(run(indexer_kl_reference, iq, ik, w, idx, tgt, kw))
    np.testing.assert_array_equal(got, ref)


def test_special_rows_are_exactly_zero():
    """All-invalid rows, all-zero target rows and rows whose target sits only
    on invalid slots give exactly 0; mass on invalid slots is ignored."""
    S, N, T, HI, DI = 6, 10, 8, 4, 16
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-special"), S=S, HI=HI, DI=DI, N=N, T=T,
                                                  causal=False, zero_rows=0.0, invalid_fraction=0.0)
    idx, tgt = np.array(idx), np.array(tgt)
    idx[0] = [INT32_MIN, -1, N, N + 1, INT32_MAX, -7, N * 3, -(2**30)]  # row 0: no valid slot
    tgt[1] = 0.0                                                        # row 1: no target
    tgt[2, :4] = 0.0
    idx[2, 0, 4:] = -1                                                  # row 2: target only on invalid slots
    tgt_moved = tgt.copy()
    tgt_moved[3, 0] += 5.0
    idx[3, 0, 0] = N                                                    # row 3: extra mass on an invalid slot
    got = np.asarray(indexer_kl(iq, ik, w, jnp.asarray(idx), jnp.asarray(tgt), **kw))
    assert got[0] == 0.0 and got[1] == 0.0 and got[2] == 0.0
    moved = np.asarray(indexer_kl(iq, ik, w, jnp.asarray(idx), jnp.asarray(tgt_moved), **kw))
    assert moved[3] == got[3]
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **kw))
    g = jax.grad(lambda a, b, c: indexer_kl(a, b, c, jnp.asarray(idx), jnp.asarray(tgt), **kw)[:3].sum(),
                 argnums=(0, 1, 2))(iq, ik, w)
    for x in g:
        assert np.all(np.asarray(x, np.float32) == 0.0)


def test_large_logits_stay_accurate():
    """Logits in the hundreds: the KL is formed around the row maximum."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-large"), S=8, HI=16, DI=64, N=50, T=32,
                                                  dtype=F32, scale=300.0)
    got = indexer_kl(iq, ik, w, idx, tgt, **kw)
    want = oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **kw)
    oracle.assert_indexer_close(got, want)


@pytest.mark.parametrize("chunk", [1, 3, 7, 40])
def test_chunk_loop(chunk):
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-chunk"), B=2, S=9, HI=8, DI=16, N=20, T=12,
                                                  q_start_index="batch", dtype=F32)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    params = dict(scale=kw["scale"], causal=kw["causal"], k_stride=kw["k_stride"])
    none = checks.no_row_ranges(2, 9)
    whole = indexer_reference_canonical(iq, ik, w, idx, tgt, qs, none, **params)
    part = jax.jit(lambda *a: indexer_reference_canonical(*a, chunk=chunk, **params))(iq, ik, w, idx, tgt, qs, none)
    for a, b in zip(part, whole):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_empty_problems():
    for S, T, N in [(0, 4, 5), (3, 0, 5), (3, 4, 0)]:
        iq = jnp.ones((S, 2, 16), BF16)
        ik = jnp.ones((N, 16), BF16)
        w = jnp.ones((S, 2), F32)
        idx = jnp.zeros((S, 1, T), jnp.int32)
        tgt = jnp.ones((S, T), F32)
        out = indexer_kl(iq, ik, w, idx, tgt)
        assert out.shape == (S,) and np.all(np.asarray(out) == 0)
        g = jax.grad(lambda a, c: indexer_kl(a, ik, c, idx, tgt).sum(), argnums=(0, 1))(iq, w)
        assert all(np.all(np.asarray(x, np.float32) == 0) for x in g)
    out = indexer_kl(jnp.ones((0, 3, 2, 16), BF16), jnp.ones((0, 5, 16), BF16), jnp.ones((0, 3, 2), F32),
                     jnp.zeros((0, 3, 1, 4), jnp.int32), jnp.ones((0, 3, 4), F32))
    assert out.shape == (0, 3)


# ----------------------------------------------------------------------------
# indexer_loss
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("lse_base,B", [("2", None), ("e", 2)])
def test_indexer_loss_equals_indexer_kl_on_attn_dists_target(lse_base, B):
    p = synthetic.make_problem(S=12, N=30, H=70, T=8, D=32, B=B, lse_base=lse_base, seed=4)
    ix = synthetic.make_indexer(p, HI=8, DI=16, seed=4)
    kw = p.kwargs
    # eagerly: op by op, the same float32 arithmetic on both sides
    got = indexer_loss(p.q, p.k, p.lse, *ix.arrays, p.indices, scale=0.7, **kw)
    dist = attn_dist(*p.arrays, **kw)  # [B?, G, S, T]: the target's sums in their fixed order
    target = target_from_dist(dist if B is not None else dist[None])
    target = target if B is not None else target[0]
    want = indexer_kl(*ix.arrays, p.indices, target, scale=0.7, causal=kw["causal"],
                      q_start_index=kw["q_start_index"], k_stride=kw["k_stride"])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # against float64 end to end
    ref_dist = oracle.attn_dist_oracle(*p.arrays, **kw)
    m64 = ref_dist.sum(axis=-3)
    t64 = m64 / np.where(m64.sum(-1, keepdims=True) > 0, m64.sum(-1, keepdims=True), 1)
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(*ix.arrays, p.indices, t64, scale=0.7,
                                                              causal=kw["causal"], q_start_index=kw["q_start_index"],
                                                              k_stride=kw["k_stride"]))
    # no gradient reaches the main attention's inputs
    gq, gk, gl = jax.jit(jax.grad(lambda q, k, l: indexer_loss(q, k, l, *ix.arrays, p.indices, **kw).sum(),
                                  argnums=(0, 1, 2)))(p.q, p.k, p.lse)
    assert all(np.all(np.asarray(x, np.float32) == 0) for x in (gq, gk, gl))


def _halving_sum(x):
    """The order that sum_in_fixed_order promises, in float32 NumPy: the last
    axis zero-padded to a power of two, its halves added until one is left."""
    x = np.asarray(x, np.float32)
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    x = np.concatenate([x, np.zeros(x.shape[:-1] + (width - x.shape[-1],), np.float32)], axis=-1)
    while x.shape[-1] > 1:
        x = x[..., : x.shape[-1] // 2] + x[..., x.shape[-1] // 2:]
    return x[..., 0]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 513, 2048])
def test_target_sums_run_in_one_order_whatever_the_rows(n):
    # Terms over 12 binades: a different order of the adds changes the bits.
    rng = np.random.default_rng(n)
    dist = (rng.random((2, 3, 40, n)) * np.exp2(rng.integers(-12, 0, (2, 3, 40, n)))).astype(np.float32)
    dist[0, :, 5] = 0.0  # a row with no mass: target 0
    for axis in (1, -1):
        want = _halving_sum(np.moveaxis(dist, axis, -1))
        got = np.asarray(jax.jit(lambda x: sum_in_fixed_order(x, axis))(jnp.asarray(dist)))
        assert got.tobytes() == want.tobytes()
    # A row's target is the same bits when computed alone or among others
    # (as on one shard of a row-sharded program).
    whole = np.asarray(jax.jit(target_from_dist)(jnp.asarray(dist)))
    part = np.asarray(jax.jit(target_from_dist)(jnp.asarray(dist[:, :, 17:23])))
    assert part.tobytes() == whole[:, 17:23].tobytes()
    mass = _halving_sum(np.moveaxis(dist, 1, -1))
    total = _halving_sum(mass)[..., None]
    want = np.where(total > 0, mass / np.where(total > 0, total, 1), 0)
    np.testing.assert_allclose(whole, want, rtol=1e-6, atol=0)  # XLA may divide by a reciprocal
    assert not whole[0, 5].any()


def test_fixed_order_sum_takes_float32_and_float64_only():
    x = jnp.arange(6.0, dtype=jnp.float64 if jax.config.jax_enable_x64 else jnp.float32).reshape(2, 3)
    assert np.asarray(sum_in_fixed_order(x, -1)).tolist() == [3.0, 12.0]
    for dtype in (jnp.bfloat16, jnp.int32, jnp.bool_):
        with pytest.raises(TypeError, match="float32 or float64"):
            sum_in_fixed_order(jnp.ones((2, 3), dtype), 0)
