"""The SM90 indexer_topk kernel on the GPU, through the public API with
implementation="cuda": every row against the float64 oracle under SPEC
§9.3's acceptance rule, causal and not, packed rows, batches with per-batch
q_start (at the int32 limits too, and with rows of fewer valid keys than
topk or none), malformed cu_seqlens (SPEC §6.3) and raw row ranges through
the primitive, exact ties, determinism, and the indices feeding indexer_kl.
GPU only (see conftest.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import INT32_LIMIT_STARTS, INT32_MAX, INT32_MIN, register_kernels, seed_of
from jax_attn_dist import indexer_kl, indexer_topk, oracle
from jax_attn_dist.oracle import indexer_topk as topk_oracle
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from jax_attn_dist.ops.indexer_topk.autodiff import indexer_topk_canonical
from topk_inputs import (FP8, adversarial_topk_ranges, assert_row_kinds, cancellation, check_selection,
                         kernel_band, make_topk_inputs, negative_heads_inputs, raw_range_logits, valid_counts,
                         widest_band)

pytestmark = pytest.mark.gpu

register_kernels()

HI, DI = 64, 128


@dataclasses.dataclass(frozen=True)
class Case:
    S: int
    N: int
    topk: int
    B: int | None = None
    causal: bool = True
    k_stride: int = 1
    per_batch_q_start: bool = False
    q_start: tuple | None = None    # given per-batch q_start (B entries), in place of a drawn one

    @property
    def name(self) -> str:
        return (f"S{self.S}-N{self.N}-k{self.topk}-B{self.B}-c{int(self.causal)}-ks{self.k_stride}"
                f"-pb{int(self.per_batch_q_start)}" + (f"-qs{self.q_start_tag}" if self.q_start else ""))

    @property
    def q_start_tag(self) -> str:
        names = {INT32_MIN: "MIN", INT32_MIN + 3: "MIN+3", INT32_MAX - 5: "MAX-5", INT32_MAX: "MAX"}
        return ",".join(names.get(q, str(q)) for q in self.q_start)

    @property
    def kinds(self) -> tuple:
        """The row kinds (topk_inputs.assert_row_kinds) a case with given
        q_start is built to have."""
        return ("empty", "short", "select") if self.q_start else ()


# Per-batch q_start at the int32 limits (SPEC §9.2), with one ordinary start
# whose first rows see no key, then fewer than topk. k_stride 2^28: the
# limits' rows see 7 or 8 keys (INT32_MAX - 5: 7 for s < 5, so the pair
# (4, 5) has a row written directly and one selecting), 3 * 2^28 - 2 gives 2
# or 3. N = 20000: INT32_MAX's rows select in several chunks.
LIMIT_CASES = [
    Case(S=64, N=3000, topk=64, B=5, q_start=INT32_LIMIT_STARTS + (-21,)),
    Case(S=64, N=3000, topk=64, B=5, k_stride=3, q_start=INT32_LIMIT_STARTS + (-21,)),
    Case(S=16, N=3000, topk=7, B=5, k_stride=1 << 28, q_start=INT32_LIMIT_STARTS + (3 * (1 << 28) - 2,)),
    Case(S=24, N=20000, topk=512, B=5, q_start=INT32_LIMIT_STARTS + (-10,)),
]

# One batch element starting before its keys: its first rows see no key,
# then fewer than topk (-1 padding), then more (the pair (276, 277), (52,
# 53): one row of exactly topk keys, written directly, and one selecting);
# the other selects, with N <= 8192 in one chunk, with N > 8192 (q_start
# 15000) in several.
SHORT_ROW_CASES = [
    Case(S=300, N=5000, topk=256, B=2, q_start=(-21, 3000)),
    Case(S=64, N=20000, topk=32, B=2, q_start=(-21, 15000)),
    Case(S=200, N=4096, topk=64, B=2, k_stride=4, q_start=(-9, 2000)),
]


CASES = [
    Case(S=1, N=1, topk=1),
    Case(S=1, N=1, topk=64, causal=False),
    Case(S=7, N=50, topk=64),                                  # N < topk
    Case(S=300, N=5000, topk=2048),
    Case(S=300, N=5000, topk=2048, causal=False),
    Case(S=128, N=3000, topk=64, B=2, per_batch_q_start=True),
    Case(S=65, N=1000, topk=1, causal=False),
    Case(S=200, N=4096, topk=2048, k_stride=4),
    Case(S=33, N=2047, topk=2048, causal=False),               # N = topk - 1: every key, then one -1
    Case(S=100, N=5000, topk=64, B=3, k_stride=2),
    Case(S=24, N=20000, topk=2048, causal=False),             # more than one chunk: the streaming selection
    Case(S=40, N=20000, topk=512, B=2, per_batch_q_start=True),
] + LIMIT_CASES + SHORT_ROW_CASES + [
    # topk at the streaming selection's limit (segments of 512 keys), and
    # past it (a GEMM pass per radix round, then the output pass)
    Case(S=16, N=20000, topk=3584, causal=False),
    Case(S=16, N=20000, topk=3600, causal=False),
    Case(S=20, N=40000, topk=4000, B=2, per_batch_q_start=True),
]

# Where N fits one chunk and the row pairs outnumber the SMs, the kernel is
# resident (one CTA per SM over its pairs): the 1500-row batches give each
# CTA about eleven pairs, selecting and not (the first q_start's early rows
# see no key or fewer than topk); S = 300 about one and a bit; the smaller
# cases run the multi-pass kernel. N = 6001: the second batch element starts
# its keys (and scales, where drawn) off a 16-byte boundary. topk = 32 with
# q_start -5: pairs whose keys are one block (one warpgroup with none).
# q_start 6500 at N = 8192: rows of 6501 keys up to the whole chunk (V3.2's
# long rows: the selector reads a buffer of up to 8192 logits a row).
RESIDENT_CASES = [
    Case(S=1500, N=6000, topk=512, B=2, q_start=(-700, 100)),
    Case(S=1500, N=6001, topk=512, B=2, q_start=(-700, 100)),
    Case(S=300, N=3000, topk=32, B=1, q_start=(-5,)),
    Case(S=1800, N=8192, topk=2048, B=2, q_start=(-300, 6500)),
]
CASES += RESIDENT_CASES

# float8 inputs (with index_k_scale): one chunk, batch, and several chunks,
# resident and not. N = 20003: the batch elements past the first start their
# keys off a 16-byte boundary.
FP8_CASES = [
    Case(S=300, N=5000, topk=2048),
    *RESIDENT_CASES,
    Case(S=40, N=20003, topk=512, B=3, per_batch_q_start=True),
    Case(S=128, N=3000, topk=64, B=2, per_batch_q_start=True),
    Case(S=33, N=2047, topk=2048, causal=False),
    Case(S=24, N=20000, topk=2048, causal=False),
    Case(S=40, N=20000, topk=512, B=2, per_batch_q_start=True),
    Case(S=16, N=20000, topk=3600, causal=False),
    LIMIT_CASES[0], LIMIT_CASES[2], LIMIT_CASES[3], SHORT_ROW_CASES[0], SHORT_ROW_CASES[1],
]


def _kernel(iq, ik, w, kw, topk, **packing):
    """indexer_topk on the kernel under jit (q_start_index traced)."""
    kw = dict(kw, **packing)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    f = jax.jit(lambda a, b, c, s: indexer_topk(a, b, c, topk=topk, q_start_index=s, implementation="cuda", **kw))
    assert topk_contract.FFI_TARGET in f.lower(iq, ik, w, qs).as_text()
    return f(iq, ik, w, qs)


def _inputs(case: Case, **extra):
    qs = "batch" if case.per_batch_q_start else None
    if case.q_start:
        qs = 0
    elif qs is None and case.causal:
        qs = int(np.random.default_rng(seed_of("topk-gpu-qs", case.name)).integers(-3, case.N * case.k_stride))
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-gpu", case.name), B=case.B, S=case.S, HI=HI, DI=DI, N=case.N,
                                     causal=case.causal, k_stride=case.k_stride,
                                     q_start_index=qs if case.causal else 0, **extra)
    if case.q_start:
        assert case.B == len(case.q_start)
        kw["q_start_index"] = np.asarray(case.q_start, np.int32)
    return iq, ik, w, kw


def _kernel_on_ranges(iq, ik, w, ks, q_start, ranges, *, topk, scale):
    """The primitive (the lowest entry that takes raw row ranges, SPEC §6's
    operand) on the kernel, causal=True with a q_start the ranges replace."""
    f = jax.jit(lambda *a: indexer_topk_canonical(*a, topk=topk, scale=scale, causal=True, k_stride=1,
                                                  implementation="cuda"))
    assert topk_contract.FFI_TARGET in f.lower(iq, ik, w, ks, q_start, ranges).as_text()
    return f(iq, ik, w, ks, q_start, ranges)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_float64(case):
    iq, ik, w, kw = _inputs(case)
    logits = check_selection(_kernel(iq, ik, w, kw, case.topk), iq, ik, w, kw, case.topk)
    assert_row_kinds(logits, case.topk, case.kinds)


@pytest.mark.parametrize("case", FP8_CASES, ids=[c.name for c in FP8_CASES])
def test_fp8_kernel_matches_float64(case):
    """float8 index_q/index_k times index_k_scale, against the float64
    logits of the float8 values, under the float8 kernel's band."""
    iq, ik, w, kw = _inputs(case, dtype=FP8)
    got = _kernel(iq, ik, w, kw, case.topk)
    logits = check_selection(got, iq, ik, w, kw, case.topk, rtol=kernel_band(FP8))
    assert_row_kinds(logits, case.topk, case.kinds)
    print(f"{case.name}: widest band {widest_band(got, logits, case.topk):.3g}")


@pytest.mark.parametrize("S", [64, 300], ids=["multi-pass", "resident"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
def test_kernel_with_negative_key_scales(dtype, S):
    """A key's negative scale turns relu(z * scale) into scale * min(z, 0), in
    both kernels (S = 300: more row pairs than SMs, the resident one)."""
    case = Case(S=S, N=3000, topk=256, causal=False)
    iq, ik, w, kw = _inputs(case, dtype=dtype, key_scale=True)
    ks = np.asarray(kw["index_k_scale"])
    kw = dict(kw, index_k_scale=jnp.asarray(np.where(np.arange(case.N) % 3 == 0, -ks, ks)))
    got = _kernel(iq, ik, w, kw, case.topk)
    logits = check_selection(got, iq, ik, w, kw, case.topk, rtol=kernel_band(dtype))
    print(f"negative scales: widest band {widest_band(got, logits, case.topk):.3g}")


@pytest.mark.parametrize("heads", [1, 32, 63])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
def test_fewer_heads_than_the_variant(heads, dtype):
    """HI below the variant's 64 heads: the heads past HI weigh 0 (one chunk
    and several)."""
    for case in (Case(S=96, N=3000, topk=256), Case(S=24, N=20000, topk=512, causal=False)):
        iq, ik, w, kw = make_topk_inputs(seed_of("topk-gpu-heads", heads, case.name), S=case.S, HI=heads, DI=DI,
                                         N=case.N, causal=case.causal, q_start_index=case.N - case.S if case.causal
                                         else 0, dtype=dtype)
        check_selection(_kernel(iq, ik, w, kw, case.topk), iq, ik, w, kw, case.topk, rtol=kernel_band(dtype))


@pytest.mark.parametrize("case", [Case(S=64, N=3000, topk=256, causal=False),
                                  Case(S=64, N=3001, topk=256, B=3, causal=False), RESIDENT_CASES[1]],
                         ids=lambda c: c.name)
def test_kernel_with_key_scales_and_bf16_weights(case):
    iq, ik, w, kw = _inputs(case, key_scale=True, weights_dtype=jnp.bfloat16)
    check_selection(_kernel(iq, ik, w, kw, case.topk), iq, ik, w, kw, case.topk)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_rows(causal, dtype):
    """Packed sequences with distinct key scales; the selecting one's keys
    start at 1001, off a 16-byte boundary (the multi-pass kernels: 128 row
    pairs)."""
    S, N, topk = 256, 3000, 512
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-gpu-packed", causal, str(jnp.dtype(dtype))), S=S, HI=HI, DI=DI,
                                     N=N, causal=causal, dtype=dtype, key_scale=True)
    rtol = kernel_band(dtype)
    cu_q = np.asarray([0, 40, 41, 180, 250], np.int32)          # rows 250.. are padding
    cu_k = np.asarray([0, 1000, 1001, 2900, 3000], np.int32)
    kw = dict(kw, q_start_index=np.asarray([0, 7, 960, 30], np.int32))
    packing = dict(cu_seqlens_q=jnp.asarray(cu_q), cu_seqlens_k=jnp.asarray(cu_k))
    got = _kernel(iq, ik, w, kw, topk, **packing)
    check_selection(got, iq, ik, w, kw, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, rtol=rtol)
    assert np.all(np.asarray(got)[250:] == -1)
    xla = jax.jit(lambda a, b, c: indexer_topk(a, b, c, topk=topk, implementation="xla", **kw, **packing))(iq, ik, w)
    check_selection(xla, iq, ik, w, kw, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, rtol=rtol)


def _packed_resident_logits(seed, dtype, N, cu_k, cu_q, q_start, S=600, topk=256):
    """The resident kernel (300 row pairs, N <= 8192) on packed rows with
    distinct key scales, every row checked; returns the float64 logits."""
    iq, ik, w, kw = make_topk_inputs(seed, S=S, HI=HI, DI=DI, N=N, dtype=dtype, key_scale=True)
    rtol = kernel_band(dtype)
    cu_q, cu_k = np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32)
    kw = dict(kw, q_start_index=np.asarray(q_start, np.int32))
    got = _kernel(iq, ik, w, kw, topk, cu_seqlens_q=jnp.asarray(cu_q), cu_seqlens_k=jnp.asarray(cu_k))
    return check_selection(got, iq, ik, w, kw, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, rtol=rtol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
def test_packed_rows_resident(dtype):
    """The second sequence's keys start at key 2999, off a 16-byte boundary;
    every row selects."""
    seed = seed_of("topk-gpu-packed-resident") if dtype == FP8 else seed_of("topk-gpu-packed-resident", "bf16")
    logits = _packed_resident_logits(seed, dtype, N=6000, cu_k=[0, 2999, 6000], cu_q=[0, 300, 600],
                                     q_start=[500, 1000])
    assert_row_kinds(logits, 256, ("select",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
def test_packed_rows_resident_past_half_a_chunk(dtype):
    """Rows past half a chunk: the first sequence's rows see 4701 to 5000
    keys, and the pair (300, 301) straddles the sequences, its second row's
    keys starting 5000 keys into the pair's logits buffer."""
    seed = seed_of("topk-gpu-packed-halves", "fp8" if dtype == FP8 else "bf16")
    logits = _packed_resident_logits(seed, dtype, N=8000, cu_k=[0, 5000, 8000], cu_q=[0, 301, 600],
                                     q_start=[4700, 2000])
    counts = valid_counts(logits)
    assert (counts > 256).all()
    np.testing.assert_array_equal(counts[[0, 299, 300, 301, 599]], [4701, 5000, 5000, 2001, 2299])


# SPEC §6.3 through the public API: (name, cu_seqlens_q, cu_seqlens_k, the
# rows of no sequence); S = 256, N = 3000, three sequences (well-formed:
# rows 0-39 on keys 0-999, rows 40-179 on 1000-2899, rows 180-255 on
# 2900-2999). Causal with q_start [-10, 400, 480]: every case has rows of no
# key, of fewer than topk and of more.
MALFORMED = [
    ("q-negative", [-5, 40, 180, 256], [0, 1000, 2900, 3000], range(0, 40)),
    ("k-negative", [0, 40, 180, 256], [-1, 1000, 2900, 3000], range(0, 40)),
    ("q-past-S", [0, 40, 180, 300], [0, 1000, 2900, 3000], range(180, 256)),
    ("k-past-N", [0, 40, 180, 256], [0, 1000, 2900, 3001], range(180, 256)),
    ("extremes", [INT32_MIN, 40, 180, INT32_MAX], [0, 1000, 2900, INT32_MAX],
     list(range(0, 40)) + list(range(180, 256))),
    ("k-extremes", [0, 40, 180, 256], [INT32_MIN, INT32_MAX, 2000, 3000], range(0, 180)),
    ("decreasing-q", [0, 40, 30, 256], [0, 1000, 1000, 3000], range(30, 40)),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,cu_q,cu_k,dead", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_boundaries(name, cu_q, cu_k, dead, causal):
    """Negative boundaries, boundaries past S or N (up to INT32_MAX) and
    decreasing ones, traced: the rows they touch all -1, the others as the
    float64 rule says."""
    S, N, topk = 256, 3000, 512
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-gpu-malformed", name, causal), S=S, HI=HI, DI=DI, N=N,
                                     causal=causal)
    cu_q, cu_k = np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32)
    kw = dict(kw, q_start_index=np.asarray([-10, 400, 480], np.int32))
    packing = dict(cu_seqlens_q=jnp.asarray(cu_q), cu_seqlens_k=jnp.asarray(cu_k))
    got = _kernel(iq, ik, w, kw, topk, **packing)
    logits = check_selection(got, iq, ik, w, kw, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dead = list(dead)
    assert np.all(np.asarray(got)[dead] == -1)
    assert np.all(valid_counts(logits)[dead] == 0)
    assert_row_kinds(logits, topk, ("empty", "short", "select") if causal else ("empty",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("N,topk", [(3000, 64), (20000, 512)])
def test_kernel_on_raw_row_ranges(N, topk, dtype):
    """The kernel through the primitive on raw row ranges: negative values,
    values past N, INT32_MIN/MAX, ends before beginnings, rows of 3 keys,
    fewer than topk, none, all, topk and topk + 1; against the clamp rule
    (keys into [0, N]) and the float64 logits. q_start and causal=True are
    replaced by the ranges; field 2 is not read. N = 20000: pairs of rows
    whose ranges' union takes several chunks."""
    B, S = 2, 48
    tag = ("topk-gpu-raw-ranges", N, jnp.dtype(dtype).name)
    iq, ik, w, kw = make_topk_inputs(seed_of(*tag), B=B, S=S, HI=HI, DI=DI, N=N, dtype=dtype, key_scale=True)
    ranges = adversarial_topk_ranges(np.random.default_rng(seed_of(*tag)), B, S, N, topk)
    q_start = jnp.asarray([INT32_MIN, 7], jnp.int32)
    got = _kernel_on_ranges(iq, ik, w, kw["index_k_scale"], q_start, jnp.asarray(ranges), topk=topk,
                            scale=kw["scale"])
    logits = raw_range_logits(iq, ik, w, kw, ranges)
    rtol = kernel_band(dtype)
    assert np.asarray(got).shape == (B, S, 1, topk)
    topk_oracle.assert_topk_acceptable(got, logits, topk, rtol)
    assert_row_kinds(logits, topk)
    np.testing.assert_array_equal(valid_counts(logits)[0, :6], [3, topk - 1, 0, N, topk, topk + 1])


def _check_ties_among_copies(seed_name, topk, S, dtype=jnp.bfloat16, N=5000):
    """2 * topk + 3 copies of one key (at most N - 1), the largest logits of
    every row: whenever the cut falls among them, the smaller copies are kept
    (float8: the copies share a key scale too)."""
    iq, ik, w, kw = make_topk_inputs(seed_of(seed_name, topk), S=S, HI=HI, DI=DI, N=N, causal=False, dtype=dtype)
    rng = np.random.default_rng(seed_of(seed_name + "-keys", topk))
    copies = np.sort(rng.choice(N, size=min(2 * topk + 3, N - 1), replace=False))
    if dtype == FP8:
        iq, w = jnp.abs(iq.astype(jnp.float32)).astype(FP8), jnp.abs(w)
        ik = ik.at[jnp.asarray(copies)].set((jnp.abs(ik[0].astype(jnp.float32)) + 1).astype(FP8))
        kw = dict(kw, index_k_scale=kw["index_k_scale"].at[jnp.asarray(copies)].set(4.0))
    else:
        iq, w = jnp.abs(iq), jnp.abs(w)
        ik = ik.at[jnp.asarray(copies)].set(jnp.abs(ik[0]) + 1)
    got = np.asarray(_kernel(iq, ik, w, kw, topk))
    logits = check_selection(got, iq, ik, w, kw, topk, rtol=kernel_band(dtype))
    for s in range(S):
        np.testing.assert_array_equal(got[s, 0], copies[:topk])
        # The copies' exact logits are equal; the float64 matmul's blocking
        # may round the same dot product differently in different columns,
        # which the exact selection would then take for an order.
        row = logits[s].copy()
        assert np.ptp(row[copies]) <= 1e-12 * np.abs(row[copies]).max()
        row[copies] = row[copies[0]]
        np.testing.assert_array_equal(got[s, 0], topk_oracle.exact_topk(row, topk))


@pytest.mark.parametrize("S, N, topk", [(300, 3000, 256), (24, 20000, 512)], ids=["resident", "several-chunks"])
def test_logits_dominated_by_negative_heads(S, N, topk):
    """negative_heads_inputs: sum_h |w z| about a hundred times a row's
    largest logit, most logits exactly 0. A float32 form of the logit whose
    rounding scales with sum_h |w z| rather than with the logit (the relu
    identity (qw . k + sum_h w |z|) / 2, PERFORMANCE.md) comes near the edge
    of SPEC §9.3's band here, in a NumPy model of its rounding; the kernel
    must stay inside it."""
    iq, ik, w, kw = negative_heads_inputs(seed_of("topk-gpu-negative-heads", S, N), S=S, N=N, HI=HI, DI=DI)
    logits = check_selection(_kernel(iq, ik, w, kw, topk), iq, ik, w, kw, topk)
    assert np.median(cancellation(iq, ik, w, logits)) > 50  # the regime this test is for


@pytest.mark.parametrize("topk", [1, 64, 2048])
def test_exact_ties_go_to_the_smaller_key(topk):
    _check_ties_among_copies("topk-gpu-ties", topk, S=48)


@pytest.mark.parametrize("topk", [1, 64, 2048, 3600])
def test_exact_ties_in_several_chunks(topk):
    """The same where the keys span several chunks: the streaming selection
    (whose candidates are in no key order: a tie at the cut goes to the
    smaller key index, and a later copy never joins) and, at topk = 3600, the
    multi-pass kernel's radix passes."""
    _check_ties_among_copies("topk-gpu-ties-chunks", topk, S=8, N=20000)


def _check_ramp_logits(order, topk, dtype, *, S, N):
    """One key row for every key, its dot products positive, times distinct
    index_k_scale values from a ramp: logits distinct and in the ramp's
    order, so that the selection is known exactly (the keys of the topk
    largest scales)."""
    name = ("topk-gpu-ramp", order, topk, N, jnp.dtype(dtype).name)
    iq, ik, w, kw = make_topk_inputs(seed_of(*name), S=S, HI=HI, DI=DI, N=N, causal=False, dtype=dtype,
                                     key_scale=True)
    iq = jnp.abs(iq.astype(jnp.float32)).astype(iq.dtype)
    ik = jnp.broadcast_to(jnp.abs(ik[:1].astype(jnp.float32)) + 0.25, ik.shape).astype(ik.dtype)
    w = jnp.abs(w)
    ramp = np.linspace(1.0, 2.0, N, dtype=np.float32)
    scales = {"ascending": ramp, "descending": ramp[::-1].copy(),
              "shuffled": np.random.default_rng(seed_of(*name, "perm")).permutation(ramp)}[order]
    kw = dict(kw, index_k_scale=jnp.asarray(scales))
    got = np.asarray(_kernel(iq, ik, w, kw, topk))
    logits = check_selection(got, iq, ik, w, kw, topk, rtol=kernel_band(dtype))
    want = np.sort(np.argsort(-scales, kind="stable")[:topk])
    for s in range(S):
        np.testing.assert_array_equal(got[s, 0], want)
        np.testing.assert_array_equal(got[s, 0], topk_oracle.exact_topk(logits[s], topk))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
@pytest.mark.parametrize("topk", [64, 2048, 3584])
def test_streaming_ramp_logits(order, topk, dtype):
    """Distinct logits over several chunks, checked exactly: rising with the
    key index (every key joins the candidates, cut back whenever they could
    overflow: at topk 3584 after every 512-key segment, the buffer then
    full), falling (after the first cut-back no key joins) and in a random
    order (keys joining and refused just above and below the cut)."""
    _check_ramp_logits(order, topk, dtype, S=6, N=20000)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
def test_streaming_rows_past_one_bitmap_window(dtype):
    """Rows of 70000 keys: the output is written from a bitmap of 65536 keys
    at a time, here two windows."""
    _check_ramp_logits("shuffled", 2048, dtype, S=4, N=70000)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("topk", [512, 2048])
def test_resident_exact_ties(topk, dtype):
    """The same in the resident kernel (300 row pairs, more than the SMs):
    the cut falls among the copies, every radix round down to the last bit."""
    name = "topk-gpu-fp8-ties" if dtype == FP8 else "topk-gpu-resident-ties"
    _check_ties_among_copies(name, topk, S=600, dtype=dtype)


@pytest.mark.parametrize("case", [Case(S=300, N=5000, topk=2048, B=2, per_batch_q_start=True),
                                  Case(S=24, N=20000, topk=2048, causal=False)],
                         ids=["one-chunk", "streaming"])
def test_deterministic(case):
    """The same bits in every run (streaming: candidates appended in an
    order that varies from run to run)."""
    iq, ik, w, kw = _inputs(case)
    first = np.asarray(_kernel(iq, ik, w, kw, case.topk))
    for _ in range(2):
        assert np.asarray(_kernel(iq, ik, w, kw, case.topk)).tobytes() == first.tobytes()


def test_indices_feed_indexer_kl():
    """The output round-trips: the selected indices are indexer_kl's operand
    as they are (their -1 padding is an invalid slot there)."""
    S, N, topk = 96, 1500, 256
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-gpu-kl"), B=2, S=S, HI=HI, DI=DI, N=N, q_start_index="batch")
    idx = _kernel(iq, ik, w, kw, topk)
    rng = np.random.default_rng(1)
    target = rng.random((2, S, topk)).astype(np.float32)
    target /= target.sum(-1, keepdims=True)
    kl_kw = dict(scale=kw["scale"], q_start_index=kw["q_start_index"])
    kl = jax.jit(lambda a, b, c, i, t: indexer_kl(a, b, c, i, t, implementation="cuda", **kl_kw))(
        iq, ik, w, idx, jnp.asarray(target))
    want = oracle.indexer_kl_oracle(iq, ik, w, idx, target, scale=kw["scale"],
                                    q_start_index=np.asarray(kw["q_start_index"]))
    oracle.assert_indexer_close(kl, want)
