"""SPEC §6's test problems (packed sequences, per-row top-k lengths): the
cases, their inputs, and a traced call. Not a test file: the jnp path's tests
(packing/test_*.py), the kernels' (packing/test_gpu.py) and sanitizer_run.py
use them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from inputs import INT32_MAX, INT32_MIN, make_indexer_inputs, seed_of
from jax_attn_dist import oracle

F32 = jnp.float32

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


@functools.lru_cache(maxsize=None)
def _traced(fn, rule_items, names):
    """One jitted function per (fn, static rule, §6 keywords given), so that
    cases of one shape compile once."""
    rule = dict(rule_items)

    @jax.jit
    def f(arrays, qs, pk_vals):
        return fn(*arrays, q_start_index=qs, **rule, **dict(zip(names, pk_vals)))

    return f


def traced_call(fn, arrays, rule, pk):
    """``fn(*arrays, **rule, **pk)`` under jit, q_start_index and every §6
    array traced."""
    rule = dict(rule)
    qs = rule.pop("q_start_index")
    names = tuple(sorted(pk))
    f = _traced(fn, tuple(sorted(rule.items())), names)
    qs = jnp.asarray(qs, jnp.int32) if isinstance(qs, int) else qs
    return f(tuple(arrays), qs, tuple(pk[n] for n in names))


def no_owner_rows(case):
    if "cu_q" not in case:
        return []
    return [s for s, b in enumerate(oracle.packed_owner(case["cu_q"], case["cu_k"], case["S"], case["N"]))
            if b is None]


INDEXER_CASES = [c for c in CASES if c.get("HK", 1) == 1]


def indexer_problem(case, *, dtype=F32, HI=4, DI=16):
    S, N, T = case["S"], case["N"], case["T"]
    seed = seed_of("packed-indexer", case["name"])
    iq, ik, w, _, tgt, kw = make_indexer_inputs(seed, S=S, HI=HI, DI=DI, N=N, T=T, dtype=dtype, zero_rows=0.1)
    idx = case_indices(np.random.default_rng(seed), case)
    rule = dict(scale=kw["scale"], causal=case.get("causal", True), q_start_index=case_q_start(case),
                k_stride=case.get("k_stride", 1))
    return iq, ik, w, idx, tgt, rule, packing_kwargs(case)
