"""The jnp reference (and attn_dist's XLA path) against the float64 oracle, on
any backend (in CI: the CPU): a pairwise matrix of the API's options, the
kernel issue's semantic matrix (the same configurations the GPU sweep gives
the kernel), adversarial indices and lse, chunk loops, the causal rule at
int32 extremes and empty shapes."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn_dist import oracle
from jax_attn_dist._core import checks
from jax_attn_dist.ops.attn_dist import reference as attn_reference
from inputs import INT32_MAX, INT32_MIN, make_inputs, seed_of
from jax_attn_dist import attn_dist, attn_dist_reference
from jax_attn_dist import synthetic
from jax_attn_dist._core.chunks import chunk_rows
from attn_dist_cases import make_case_inputs, sweep_cases

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@functools.lru_cache(maxsize=None)
def _jitted(fn, params):
    """``fn`` under jit with the static ``params`` (sorted items); a
    q_start_index not among them is a traced argument. One per (fn, params),
    so that cases of one shape compile once."""
    kw = dict(params)
    if "q_start_index" in kw:
        return jax.jit(lambda q, k, i, l: fn(q, k, i, l, **kw))
    return jax.jit(lambda q, k, i, l, s: fn(q, k, i, l, q_start_index=s, **kw))


def run_jit(fn, q, k, indices, lse, kwargs, *, traced_q_start=True, **extra):
    """``fn`` under jit, with q_start_index passed as a traced argument when
    it is an array (or when ``traced_q_start`` and it is an int)."""
    kw = dict(kwargs, **extra)
    qs = kw.pop("q_start_index")
    if traced_q_start or not isinstance(qs, int):
        return _jitted(fn, tuple(sorted(kw.items())))(q, k, indices, lse, qs)
    return _jitted(fn, tuple(sorted(dict(kw, q_start_index=qs).items())))(q, k, indices, lse)


# A pairwise-style matrix: every H with batched/unbatched, the other
# parameters cycled so that each value meets several others.
_HS = (1, 16, 64, 96, 128)
_CYCLE = [
    # (HK, causal, k_stride, lse_base, dtype, q_start kind)
    (1, True, 1, "2", BF16, "int"),
    (2, True, 4, "e", BF16, "traced"),
    (1, False, 1, "e", F16, "traced"),
    (2, True, 1, "2", F32, "batch"),
    (1, True, 4, "2", BF16, "batch"),
    (2, False, 4, "e", BF16, "int"),
    (1, True, 4, "e", F32, "traced"),
]
CASES = []
for n, (H, batched) in enumerate(itertools.product(_HS, (False, True))):
    HK, causal, ks, base, dtype, qk = _CYCLE[n % len(_CYCLE)]
    if qk == "batch" and not batched:
        qk = "traced"
    D = 64 if n % 3 == 0 else 32
    HK = HK if H % HK == 0 else 1
    CASES.append(dict(H=H, batched=batched, HK=HK, causal=causal, k_stride=ks, lse_base=base, dtype=dtype, qs=qk, D=D))


def _case_id(c):
    return "H{H}-{b}-HK{HK}-{c}-ks{k_stride}-base{lse_base}-{dt}-{qs}-D{D}".format(
        b="B" if c["batched"] else "nob", c="causal" if c["causal"] else "full",
        dt=jnp.dtype(c["dtype"]).name, **{k: v for k, v in c.items() if k not in ("batched", "causal", "dtype")},
    )


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_matches_oracle(case):
    B = 2 if case["batched"] else None
    seed = seed_of("matrix", _case_id(case))
    qs = "batch" if case["qs"] == "batch" else None
    q, k, idx, lse, kw = make_inputs(
        seed, B=B, S=11, H=case["H"], D=case["D"], N=23, T=9, HK=case["HK"],
        dtype=case["dtype"], causal=case["causal"], k_stride=case["k_stride"],
        q_start_index=qs, lse_base=case["lse_base"], lse_noise=0.5,
    )
    want = oracle.attn_dist_oracle(q, k, idx, lse, **kw)
    got = run_jit(attn_dist_reference, q, k, idx, lse, kw, traced_q_start=case["qs"] != "int")
    assert got.dtype == jnp.float32
    assert got.shape == want.shape
    oracle.assert_within_spec(got, want)
    # attn_dist's XLA path is the same computation.
    got2 = run_jit(attn_dist, q, k, idx, lse, kw, traced_q_start=case["qs"] != "int")
    oracle.assert_within_spec(got2, want)


@pytest.mark.parametrize("batched", [False, True])
def test_mla_shape_d576(batched):
    B = 2 if batched else None
    q, k, idx, lse, kw = make_inputs(seed_of("d576", batched), B=B, S=6, H=128, D=576, N=40, T=16)
    want = oracle.attn_dist_oracle(q, k, idx, lse, **kw)
    oracle.assert_within_spec(run_jit(attn_dist, q, k, idx, lse, kw), want)


def test_eager_matches_jit():
    q, k, idx, lse, kw = make_inputs(seed_of("eager"), S=5, H=16, D=32, N=12, T=6)
    eager = attn_dist(q, k, idx, lse, **kw)
    eager_ref = attn_dist_reference(q, k, idx, lse, **kw)
    jitted = run_jit(attn_dist, q, k, idx, lse, kw)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    oracle.assert_within_spec(eager_ref, oracle.attn_dist_oracle(q, k, idx, lse, **kw))


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunk_loop(chunk):
    """Many chunks, with a last chunk overlapping the previous one (B*S = 26)."""
    q, k, idx, lse, kw = make_inputs(
        seed_of("chunk", chunk), B=2, S=13, H=96, D=32, N=30, T=7, HK=2, q_start_index="batch", k_stride=4,
    )
    want = oracle.attn_dist_oracle(q, k, idx, lse, **kw)
    qs = jnp.asarray(kw["q_start_index"], jnp.int32)
    params = {n: kw[n] for n in ("sm_scale", "causal", "k_stride", "lse_base")}
    f = jax.jit(functools.partial(attn_reference.reference_canonical, chunk=chunk, **params))
    got = f(q, k, idx, lse, qs, checks.no_row_ranges(2, 13))
    oracle.assert_within_spec(got, want)


def test_chunk_rows_bounded_for_benchmark_shape():
    from jax_attn_dist.ops.attn_dist.contract import Problem

    p = Problem(batched=False, B=1, S=4096, H=128, D=576, N=8192, HK=1, T=2048, dtype=jnp.dtype(BF16))
    c = chunk_rows(p)
    per_row = 1 * 2048 * 576 * 2 + 3 * 128 * 2048 * 4
    assert 1 <= c <= 4096 and c * per_row <= 512 << 20


def test_adversarial_indices_exact_zero():
    """INT32_MIN, -1, N, N+1, INT32_MAX and duplicates: exactly 0 where invalid."""
    S, H, D, N, T = 8, 64, 32, 20, 12
    rng = np.random.default_rng(seed_of("adversarial"))
    q = jnp.asarray(rng.standard_normal((S, H, D)), BF16)
    k = jnp.asarray(rng.standard_normal((N, 1, D)), BF16)
    bad = np.array([INT32_MIN, -1, N, N + 1, INT32_MAX, INT32_MIN + 1, INT32_MAX - 1], np.int64)
    idx = rng.integers(0, N, (S, 1, T))
    idx[:, 0, :7] = bad
    idx[:, 0, 7] = idx[:, 0, 8]  # duplicates stay separate slots
    idx = jnp.asarray(idx, jnp.int32)
    for causal in (False, True):
        kw = dict(sm_scale=0.2, causal=causal, q_start_index=5, k_stride=1, lse_base="2")
        lse = jnp.asarray(oracle.exact_lse(q, k, idx, **kw).astype(np.float32))
        want = oracle.attn_dist_oracle(q, k, idx, lse, **kw)
        got = np.asarray(run_jit(attn_dist, q, k, idx, lse, kw))
        valid = oracle.valid_mask(np.asarray(idx)[None], N, causal=causal, q_start_index=5, k_stride=1)[0, :, 0]
        assert np.all(got[0][~valid] == 0.0)
        assert np.all(got[0][valid] > 0.0)
        assert np.all(got[0, :, 7] == got[0, :, 8])
        oracle.assert_within_spec(got, want)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_lse_gives_zero(bad):
    S, H, D, N, T = 6, 96, 32, 16, 8
    q, k, idx, lse, kw = make_inputs(seed_of("lse", str(bad)), S=S, H=H, D=D, N=N, T=T, causal=False, index_low=0, index_high=N)
    lse = np.asarray(lse).copy()
    lse[1, :] = bad  # a whole row: every head of query 1
    lse[2, 70] = bad  # one head in the partial group
    lse[3, :64] = bad  # the whole first group of query 3
    lse = jnp.asarray(lse)
    got = np.asarray(run_jit(attn_dist, q, k, idx, lse, kw))
    assert np.all(np.isfinite(got))
    assert np.all(got[:, 1] == 0.0)
    assert np.all(got[0, 3] == 0.0) and np.all(got[1, 3] > 0.0)
    np.testing.assert_allclose(got[1, 2].sum(), 31.0, rtol=1e-5)  # 32 heads, one zeroed
    oracle.assert_within_spec(got, oracle.attn_dist_oracle(q, k, idx, lse, **kw))
    oracle.assert_within_spec(run_jit(attn_dist_reference, q, k, idx, lse, kw), oracle.attn_dist_oracle(q, k, idx, lse, **kw))


def test_non_finite_lse_never_nan_with_extreme_q():
    """Large but finite q/k with a finite lse far below the logits: inf, never NaN, for valid slots."""
    S, H, D, N, T = 2, 4, 16, 4, 4
    q = jnp.full((S, H, D), 8.0, BF16)
    k = jnp.full((N, 1, D), 8.0, BF16)
    idx = jnp.asarray(np.tile(np.arange(T), (S, 1, 1)), jnp.int32)
    lse = jnp.asarray(np.array([[np.inf, -np.inf, np.nan, 0.0]] * S, np.float32))
    got = np.asarray(attn_dist(q, k, idx, lse, lse_base="2", sm_scale=1.0, causal=False))
    assert not np.any(np.isnan(got))


@pytest.mark.parametrize("lse_base", ["2", "e"])
@pytest.mark.parametrize("H", [64, 96, 128])
def test_row_sum_invariant(H, lse_base):
    """With the exact lse every head sums to 1: a group row sums to its head count."""
    p = synthetic.make_problem(S=12, N=24, H=H, T=16, D=32, B=2, lse_base=lse_base, k_stride=2, seed=H)
    out = jax.jit(lambda *a: attn_dist(*a, **p.kwargs))(*p.arrays)
    assert synthetic.invariant_error(out, p.lse) < 1e-5
    want = oracle.attn_dist_oracle(*p.arrays, **p.kwargs)
    oracle.assert_within_spec(out, want)


@pytest.mark.parametrize("q_start", [INT32_MAX - 3, INT32_MIN, INT32_MIN + 5, -7, 2**30 + 1])
@pytest.mark.parametrize("k_stride", [1, 3, 2**20])
def test_causal_rule_extreme_q_start(q_start, k_stride):
    """The causal rule is exact (floor division, no int32 overflow) for any int32 start."""
    S, H, D, N, T = 5, 1, 16, 40, 10
    rng = np.random.default_rng(seed_of("extreme", q_start, k_stride))
    q = jnp.asarray(rng.standard_normal((S, H, D)), BF16)
    k = jnp.asarray(rng.standard_normal((N, 1, D)), BF16)
    idx = jnp.asarray(rng.integers(-2, N + 2, (S, 1, T)), jnp.int32)
    lse = jnp.zeros((S, H), jnp.float32)
    kw = dict(sm_scale=0.1, causal=True, q_start_index=q_start, k_stride=k_stride, lse_base="e")
    want = oracle.attn_dist_oracle(q, k, idx, lse, **kw)
    got = np.asarray(run_jit(attn_dist_reference, q, k, idx, lse, kw))
    np.testing.assert_array_equal(got == 0.0, want == 0.0)
    oracle.assert_within_spec(got, want)


def test_causal_boundary_k_stride():
    """i <= floor((q0 + s + 1 - ks) / ks), including negative numerators."""
    N, ks, S = 8, 4, 12
    idx = np.tile(np.arange(N), (S, 1))[:, None, :]  # every key in every row
    q = jnp.ones((S, 1, 8), BF16)
    k = jnp.ones((N, 1, 8), BF16)
    lse = jnp.zeros((S, 1), jnp.float32)
    for q0 in (-5, 0, 3):
        out = np.asarray(attn_dist(q, k, jnp.asarray(idx, jnp.int32), lse, sm_scale=0.01, q_start_index=q0, k_stride=ks, lse_base="e"))
        for s in range(S):
            n_visible = max(0, min(N, (q0 + s + 1 - ks) // ks + 1))
            assert np.count_nonzero(out[0, s]) == n_visible, (q0, s)


@pytest.mark.parametrize("fn", [attn_dist, attn_dist_reference], ids=["attn_dist", "reference"])
@pytest.mark.parametrize(
    "dims", [dict(S=0), dict(T=0), dict(B=0), dict(N=0)], ids=["S0", "T0", "B0", "N0"],
)
def test_empty_shapes(fn, dims):
    d = dict(B=2, S=3, H=70, D=16, N=5, T=4)
    d.update(dims)
    B, S, H, D, N, T = (d[x] for x in "B S H D N T".split())
    q = jnp.ones((B, S, H, D), BF16)
    k = jnp.ones((B, N, 1, D), BF16)
    idx = jnp.zeros((B, S, 1, T), jnp.int32)
    lse = jnp.zeros((B, S, H), jnp.float32)
    for f in (fn, jax.jit(fn, static_argnames=("sm_scale", "lse_base"))):
        out = f(q, k, idx, lse, sm_scale=0.5, lse_base="2")
        assert out.shape == (B, 2, S, T) and out.dtype == jnp.float32
        assert not np.any(np.asarray(out))
    out = fn(q[0], k[0], idx[0], lse[0], sm_scale=0.5, lse_base="2") if B else None
    if out is not None:
        assert out.shape == (2, S, T)


def test_integer_q_start_dtypes_are_cast():
    q, k, idx, lse, kw = make_inputs(seed_of("qsdtype"), B=2, S=5, H=16, D=32, N=12, T=6, q_start_index=3)
    base = np.asarray(attn_dist(q, k, idx, lse, **kw))
    for v in (np.int64(3), np.int16(3), jnp.asarray(3, jnp.int32), jnp.asarray([3, 3], jnp.int32), np.array([3, 3], np.uint8)):
        kw2 = dict(kw, q_start_index=v)
        np.testing.assert_array_equal(np.asarray(attn_dist(q, k, idx, lse, **kw2)), base)


# The kernel issue's semantic matrix through the jnp path: the 64
# configurations the GPU sweep gives the kernel (attn_dist_cases.py): T in
# {1, 63, 64, 65, 127, 200, 2048, 2049}, H in {1, 16, 32, 64, 72, 96, 128,
# 160}, D in {512, 576}, B in {none, 1, 3}, causal or not, traced and
# per-batch q_start_index, k_stride in {1, 4}, both lse bases, 0/30/100%
# invalid slots (INT32_MIN, -1, N, INT32_MAX, causally invisible keys,
# duplicates) and +inf/-inf/NaN lse entries.
SWEEP = sweep_cases(64)


@pytest.mark.parametrize("case", SWEEP, ids=[c.name for c in SWEEP])
def test_jnp_path_matches_float64(case):
    (q, k, idx, lse, q_start), kw = make_case_inputs(case)
    if case.B is None:
        q, k, idx, lse, q_start = q[0], k[0], idx[0], lse[0], q_start[0]
    elif not case.per_batch_q_start:
        q_start = q_start[0]
    kw = {key: v for key, v in kw.items() if key != "q_start_index"}
    f = jax.jit(lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, implementation="xla", **kw))
    out = np.asarray(f(q, k, idx, lse, q_start))  # q_start traced
    ref = oracle.attn_dist_oracle(q, k, idx, lse, q_start_index=q_start, **kw)
    assert out.shape == ref.shape
    assert np.isfinite(out).all()
    valid = oracle.valid_mask(idx if case.B is not None else idx[None], case.N, causal=case.causal,
                              q_start_index=np.atleast_1d(q_start), k_stride=case.k_stride)
    out_b = out if case.B is not None else out[None]
    invalid = np.broadcast_to(~valid[:, None, :, 0, :], out_b.shape)
    assert (out_b[invalid] == 0).all()
    if np.abs(ref).max() > 0:
        oracle.assert_within_spec(out, ref)
