"""The per-row ranges SPEC §6 becomes (packing.row_ranges, an operand of
both ops' primitives): against the oracle's reading slot by slot, on random
and malformed boundaries; what the public functions hand the primitives
stays inside [0, N] x [0, T] whatever they are given; and the CUDA lowering
passes the ranges to the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import INT32_MAX, INT32_MIN, seed_of
from jax_attn_dist import attn_dist, indexer_kl, indexer_loss, oracle
from jax_attn_dist._core import chunks, packing
from jax_attn_dist.ops.indexer import contract as indexer_contract
from packed_cases import i32, indexer_problem

BF16 = jnp.bfloat16


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


def _record_row_ranges(monkeypatch):
    """Every row_ranges operand a public function hands to its ops (the
    custom-VJP entries the api modules call, which pass it on to the
    primitives, their kernels and their backward passes unchanged), recorded
    as numpy arrays as the call runs (under jit too)."""
    from jax_attn_dist.ops.attn_dist import api as attn_api
    from jax_attn_dist.ops.indexer import api as indexer_api

    seen = []

    def recording(fn, position):
        def wrapped(*args, **kw):
            jax.debug.callback(lambda r: seen.append(np.asarray(r)), args[position])
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(attn_api, "attn_dist_canonical", recording(attn_api.attn_dist_canonical, 5))
    monkeypatch.setattr(indexer_api, "attn_dist_canonical", recording(indexer_api.attn_dist_canonical, 5))
    monkeypatch.setattr(indexer_api, "indexer_kl_canonical", recording(indexer_api.indexer_kl_canonical, 6))
    return seen


def _adversarial_boundaries(rng, num_seqs, *, S, N, T):
    """cu_seqlens_q/_k [num_seqs + 1] with values far past S and N, negative,
    at the int32 extremes and decreasing; q_start per sequence (extremes
    too); topk_length [S] below 0, past T and at the extremes."""
    pool = np.array([INT32_MIN, INT32_MIN + 1, -N, -1, 0, S - 1, S, S + 1, N - 1, N, N + 1, 2 * N, N + 1000,
                     INT32_MAX - 1, INT32_MAX], np.int64)
    cu_q = np.sort(rng.integers(0, S + 1, num_seqs + 1))
    cu_k = np.sort(rng.integers(0, 3 * N, num_seqs + 1))  # most sequences reach past N
    for cu in (cu_q, cu_k):
        hit = rng.random(cu.shape) < 0.4
        cu[hit] = pool[rng.integers(0, len(pool), hit.sum())]
    q_start = rng.choice(np.array([INT32_MIN, -50, 0, 7, 3 * N, INT32_MAX - 3, INT32_MAX]), max(num_seqs, 1))
    topk = rng.choice(np.array([INT32_MIN, -5, -1, 0, 1, T - 1, T, T + 1, 10 * T, INT32_MAX]), S)
    return i32(cu_q), i32(cu_k), i32(q_start[:num_seqs] if num_seqs else 0), i32(topk)


@pytest.mark.parametrize("num_seqs", [0, 2, 7])
def test_public_functions_hand_their_ops_ranges_inside_n_and_t(num_seqs, monkeypatch):
    """Whatever cu_seqlens (past S and N, negative, int32 extremes,
    decreasing), q_start and topk_length (negative, past T, extremes) they
    get, eagerly or traced under jit, causal or not, attn_dist, indexer_kl and
    indexer_loss hand their ops (and so the kernels) row ranges with
    0 <= key_begin <= key_end <= N and 0 <= topk_length <= T. The kernels
    clamp raw ranges again (csrc/common/slot_validity.cuh; packing/test_gpu.py
    and sanitizer_run.py's ranges mode feed them out-of-range ones): that is a
    second line, not the first."""
    S, N, T, H, D, HI, DI = 24, 20, 8, 4, 8, 2, 8
    seen = _record_row_ranges(monkeypatch)
    rng = np.random.default_rng(seed_of("public-ranges", num_seqs))
    q = jnp.asarray(rng.standard_normal((S, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((N, 1, D)), jnp.float32)
    lse = jnp.asarray(rng.uniform(1, 3, (S, H)), jnp.float32)
    iq = jnp.asarray(rng.standard_normal((S, HI, DI)), jnp.float32)
    ik = jnp.asarray(rng.standard_normal((N, DI)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((S, HI)), jnp.float32)
    idx = jnp.asarray(rng.integers(-3, 3 * N, (S, 1, T)), jnp.int32)
    tgt = jnp.asarray(rng.random((S, T)), jnp.float32)

    def calls(cq, ck, qs, topk, *, causal, k_stride, packed):
        pk = dict(topk_length=topk, q_start_index=qs if packed else 0)
        if packed:
            pk.update(cu_seqlens_q=cq, cu_seqlens_k=ck)
        rule = dict(causal=causal, k_stride=k_stride)
        return (attn_dist(q, k, idx, lse, sm_scale=0.3, lse_base="e", **rule, **pk),
                indexer_kl(iq, ik, w, idx, tgt, **rule, **pk),
                indexer_loss(q, k, lse, iq, ik, w, idx, sm_scale=0.3, lse_base="e", **rule, **pk))

    configs = [dict(causal=True, k_stride=1, packed=True), dict(causal=True, k_stride=3, packed=True),
               dict(causal=False, k_stride=1, packed=True), dict(causal=True, k_stride=2, packed=False)]
    jitted = [jax.jit(lambda *a, kw=kw: calls(*a, **kw)) for kw in configs]
    count = 0
    for trial in range(3):
        cq, ck, qs, topk = _adversarial_boundaries(rng, num_seqs, S=S, N=N, T=T)
        for kw, f in zip(configs, jitted):
            outs = f(cq, ck, qs, topk)  # every boundary traced
            assert all(np.isfinite(np.asarray(o)).all() for o in outs)
            count += 4  # attn_dist, indexer_kl, and indexer_loss's two ops
    outs = calls(cq, ck, qs, topk, **configs[0])  # and eagerly
    count += 4
    jax.effects_barrier()
    assert len(seen) == count
    for r in seen:
        assert r.dtype == np.int32 and r.shape == (1, S, 3), (r.dtype, r.shape)
        begin, end, length = (r[..., f].astype(np.int64) for f in range(3))
        assert np.all((0 <= begin) & (begin <= end) & (end <= N)), r
        assert np.all((0 <= length) & (length <= T)), r


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
