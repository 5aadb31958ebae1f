"""The SM90 indexer_topk kernel on the GPU, through the public API with
implementation="cuda": every row against the float64 oracle under SPEC
§9.3's acceptance rule, causal and not, packed rows, batches with per-batch
q_start, exact ties, determinism, and the indices feeding indexer_kl. GPU
only (see conftest.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import register_kernels, seed_of
from jax_attn_dist import indexer_kl, indexer_topk, oracle
from jax_attn_dist.oracle import indexer_topk as topk_oracle
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from topk_inputs import FP8, check_selection, make_topk_inputs, widest_band

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

    @property
    def name(self) -> str:
        return (f"S{self.S}-N{self.N}-k{self.topk}-B{self.B}-c{int(self.causal)}-ks{self.k_stride}"
                f"-pb{int(self.per_batch_q_start)}")


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
    Case(S=24, N=20000, topk=2048, causal=False),             # more than one chunk: a GEMM pass per radix round
    Case(S=40, N=20000, topk=512, B=2, per_batch_q_start=True),
]

# float8 inputs (with index_k_scale): one chunk, batch, and several chunks.
FP8_CASES = [
    Case(S=300, N=5000, topk=2048),
    Case(S=128, N=3000, topk=64, B=2, per_batch_q_start=True),
    Case(S=33, N=2047, topk=2048, causal=False),
    Case(S=24, N=20000, topk=2048, causal=False),
    Case(S=40, N=20000, topk=512, B=2, per_batch_q_start=True),
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
    if qs is None and case.causal:
        qs = int(np.random.default_rng(seed_of("topk-gpu-qs", case.name)).integers(-3, case.N * case.k_stride))
    return make_topk_inputs(seed_of("topk-gpu", case.name), B=case.B, S=case.S, HI=HI, DI=DI, N=case.N,
                            causal=case.causal, k_stride=case.k_stride, q_start_index=qs if case.causal else 0,
                            **extra)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_float64(case):
    iq, ik, w, kw = _inputs(case)
    check_selection(_kernel(iq, ik, w, kw, case.topk), iq, ik, w, kw, case.topk)


@pytest.mark.parametrize("case", FP8_CASES, ids=[c.name for c in FP8_CASES])
def test_fp8_kernel_matches_float64(case):
    """float8 index_q/index_k times index_k_scale, against the float64
    logits of the float8 values, under the float8 kernel's band."""
    iq, ik, w, kw = _inputs(case, dtype=FP8)
    got = _kernel(iq, ik, w, kw, case.topk)
    logits = check_selection(got, iq, ik, w, kw, case.topk, rtol=topk_oracle.TOPK_TOLERANCE_FP8_KERNEL)
    print(f"{case.name}: widest band {widest_band(got, logits, case.topk):.3g}")


def test_fp8_kernel_with_negative_key_scales():
    """A key's negative scale turns relu(z * scale) into scale * min(z, 0)."""
    case = Case(S=64, N=3000, topk=256, causal=False)
    iq, ik, w, kw = _inputs(case, dtype=FP8)
    ks = np.asarray(kw["index_k_scale"])
    kw = dict(kw, index_k_scale=jnp.asarray(np.where(np.arange(case.N) % 3 == 0, -ks, ks)))
    got = _kernel(iq, ik, w, kw, case.topk)
    logits = check_selection(got, iq, ik, w, kw, case.topk, rtol=topk_oracle.TOPK_TOLERANCE_FP8_KERNEL)
    print(f"negative scales: widest band {widest_band(got, logits, case.topk):.3g}")


def test_kernel_with_key_scales_and_bf16_weights():
    case = Case(S=64, N=3000, topk=256, causal=False)
    iq, ik, w, kw = _inputs(case, key_scale=True, weights_dtype=jnp.bfloat16)
    check_selection(_kernel(iq, ik, w, kw, case.topk), iq, ik, w, kw, case.topk)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_rows(causal):
    S, N, topk = 256, 3000, 512
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-gpu-packed", causal), S=S, HI=HI, DI=DI, N=N, causal=causal)
    cu_q = np.asarray([0, 40, 41, 180, 250], np.int32)          # rows 250.. are padding
    cu_k = np.asarray([0, 1000, 1001, 2900, 3000], np.int32)
    kw = dict(kw, q_start_index=np.asarray([0, 7, 960, 30], np.int32))
    packing = dict(cu_seqlens_q=jnp.asarray(cu_q), cu_seqlens_k=jnp.asarray(cu_k))
    got = _kernel(iq, ik, w, kw, topk, **packing)
    check_selection(got, iq, ik, w, kw, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert np.all(np.asarray(got)[250:] == -1)
    xla = jax.jit(lambda a, b, c: indexer_topk(a, b, c, topk=topk, implementation="xla", **kw, **packing))(iq, ik, w)
    check_selection(xla, iq, ik, w, kw, topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("topk", [1, 64, 2048])
def test_exact_ties_go_to_the_smaller_key(topk):
    """Copies of one key with the largest logits in every row: whenever the
    cut falls among them, the smaller keys are kept."""
    S, N = 48, 5000
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-gpu-ties", topk), S=S, HI=HI, DI=DI, N=N, causal=False)
    iq, w = jnp.abs(iq), jnp.abs(w)
    rng = np.random.default_rng(seed_of("topk-gpu-ties-keys", topk))
    copies = np.sort(rng.choice(N, size=min(2 * topk + 3, N - 1), replace=False))
    ik = ik.at[jnp.asarray(copies)].set(jnp.abs(ik[0]) + 1)
    got = np.asarray(_kernel(iq, ik, w, kw, topk))
    logits = check_selection(got, iq, ik, w, kw, topk)
    for s in range(S):
        np.testing.assert_array_equal(got[s, 0], copies[:topk])
        np.testing.assert_array_equal(got[s, 0], topk_oracle.exact_topk(logits[s], topk))


def test_deterministic():
    case = Case(S=300, N=5000, topk=2048, B=2, per_batch_q_start=True)
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
