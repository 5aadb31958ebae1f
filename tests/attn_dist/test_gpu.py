"""attn_dist's SM90 kernel against the float64 oracle (SPEC §3), on the GPU
(skipped elsewhere, see conftest.py).

The kernel-level cases (attn_dist_cases.py) write into a NaN-poisoned output
(an element the kernel leaves unwritten fails): the sweep of the kernel
issue's matrix, hand-picked edge cases, full top-k blocks. The public
function's kernel path, adversarial indices and lse, determinism, 64-bit
offsets, empty problems and the FFI handler's own errors follow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn_dist
from attn_dist_cases import EDGE_CASES, Case, check_case, make_case_inputs, run_kernel, sweep_cases
from inputs import INT32_MAX, INT32_MIN, make_inputs, seed_of
from jax_attn_dist import attn_dist, attn_dist_reference, oracle, synthetic
from jax_attn_dist._core import checks
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.attn_dist.contract import FFI_TARGET

pytestmark = pytest.mark.gpu

BF16 = jnp.bfloat16
SWEEP = sweep_cases(64)


def kernel(q, k, idx, lse, kw, **extra):
    """attn_dist forced onto the kernel, under jit, q_start_index traced."""
    kw = dict(kw, **extra)
    qs = kw.pop("q_start_index")
    f = jax.jit(lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, implementation="cuda", **kw))
    return f(q, k, idx, lse, jnp.asarray(qs, jnp.int32))


def check_output(out, idx, lse, kw, N):
    """Every element written: finite; exactly 0 on invalid slots; > 0 on valid
    slots of groups with a head of finite lse (random data make exact zeros
    there impossible). HK = 1."""
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    idx, lse = np.asarray(idx), np.asarray(lse)
    if idx.ndim == 3:
        idx, lse, out = idx[None], lse[None], out[None]
    valid = oracle.valid_mask(idx, N, causal=kw["causal"], q_start_index=kw["q_start_index"], k_stride=kw["k_stride"])
    v = valid[:, :, 0, :]  # [B, S, T]
    for g in range(out.shape[1]):
        o = out[:, g]  # [B, S, T]
        assert np.all(o[~v] == 0.0)
        live = np.isfinite(lse[:, :, 64 * g : 64 * g + 64]).any(axis=-1)  # [B, S]
        assert np.all(o[v & live[:, :, None]] > 0.0)


# ----------------------------------------------------------------------------
# kernel-level cases into a poisoned output
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", SWEEP, ids=[c.name for c in SWEEP])
def test_sweep_matches_float64(case):
    check_case(case)


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.name for c in EDGE_CASES])
def test_edge_cases_match_float64(case):
    """Uniform indices with out-of-range values on both sides, a noisy lse,
    and the head counts 65 and 200 (see attn_dist_cases.EDGE_CASES)."""
    check_case(case)


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("D", attn_contract.KERNEL_HEAD_DIMS)
def test_full_topk_blocks(H, D):
    check_case(Case(S=16, H=H, T=2048, D=D, N=4096, invalid_fraction=0.1, seed=H + D))


def test_all_slots_valid_rows_sum_to_heads():
    """lse exact and no invalid slot: each group row sums to its head count."""
    case = Case(S=8, H=96, T=256, N=300, causal=False, invalid_fraction=0.0, nonfinite_lse=False, seed=7)
    out = check_case(case)
    sums = out.sum(axis=-1)  # [B, G, S]
    np.testing.assert_allclose(sums[:, 0], 64, rtol=1e-5)
    np.testing.assert_allclose(sums[:, 1], 32, rtol=1e-5)


def test_bitwise_deterministic():
    """Four runs of a batched case with full top-k blocks and more CTAs (256)
    than an H100 has SMs give the same bits."""
    case = Case(S=128, H=128, T=2048, N=8192, B=2, per_batch_q_start=True, invalid_fraction=0.1, seed=3)
    inputs, kwargs = make_case_inputs(case)
    a = run_kernel(inputs, kwargs)
    for _ in range(3):
        b = run_kernel(inputs, kwargs)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ----------------------------------------------------------------------------
# the public function's kernel path
# ----------------------------------------------------------------------------


def test_public_api_uses_kernel_with_traced_q_start():
    """attn_dist(implementation="cuda") under jit with a traced per-batch
    q_start, batched and unbatched, lowers to the kernel and matches float64."""
    case = Case(S=32, H=128, T=300, N=500, B=2, per_batch_q_start=True, seed=11)
    (q, k, idx, lse, q_start), kw = make_case_inputs(case)
    kw = {key: v for key, v in kw.items() if key != "q_start_index"}
    f = jax.jit(lambda q, k, i, l, qs: jax_attn_dist.attn_dist(q, k, i, l, q_start_index=qs,
                                                               implementation="cuda", **kw))
    hlo = f.lower(q, k, idx, lse, q_start).as_text()
    assert attn_contract.FFI_TARGET in hlo
    out = np.asarray(f(q, k, idx, lse, q_start))
    ref = oracle.attn_dist_oracle(q, k, idx, lse, q_start_index=q_start, **kw)
    oracle.assert_within_spec(out, ref)
    # Unbatched form through the same kernel.
    out0 = np.asarray(jax.jit(lambda *a: jax_attn_dist.attn_dist(*a, q_start_index=q_start[0],
                                                                 implementation="cuda", **kw))(
        q[0], k[0], idx[0], lse[0]))
    oracle.assert_within_spec(out0, oracle.attn_dist_oracle(q[0], k[0], idx[0], lse[0],
                                                            q_start_index=int(q_start[0]), **kw))


def test_kernel_is_default_on_gpu():
    p = synthetic.make_problem(S=8, N=64, H=64, T=16, D=576)
    text = jax.jit(lambda *a: attn_dist(*a, **p.kwargs)).lower(*p.arrays).as_text()
    assert FFI_TARGET in text


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("lse_base", ["2", "e"])
def test_kernel_synthetic_invariant(H, lse_base):
    p = synthetic.make_problem(S=256, N=1024, H=H, T=512, D=576, B=2, lse_base=lse_base, seed=H)
    out = kernel(*p.arrays, p.kwargs)
    assert synthetic.invariant_error(out, p.lse) < 1e-4
    oracle.assert_within_spec(out, oracle.attn_dist_oracle(*p.arrays, **p.kwargs))
    ref = jax.jit(lambda *a: attn_dist_reference(*a, **p.kwargs))(*p.arrays)
    oracle.assert_within_spec(out, ref)


def test_adversarial_indices():
    S, H, D, N, T = 16, 128, 576, 100, 64
    rng = np.random.default_rng(seed_of("gpu-adversarial"))
    idx = rng.integers(0, N, (S, 1, T))
    idx[:, 0, :8] = [INT32_MIN, -1, N, N + 1, INT32_MAX, INT32_MIN + 1, INT32_MAX - 1, -(2**30)]
    idx[:, 0, 8:12] = idx[:, 0, 12:16]  # duplicates
    idx = jnp.asarray(idx, jnp.int32)
    q = jnp.asarray(rng.standard_normal((S, H, D)), BF16)
    k = jnp.asarray(rng.standard_normal((N, 1, D)), BF16)
    for causal in (False, True):
        kw = dict(sm_scale=0.05, causal=causal, q_start_index=40, k_stride=1, lse_base="2")
        lse = jnp.asarray(oracle.exact_lse(q, k, idx, **kw).astype(np.float32))
        out = kernel(q, k, idx, lse, kw)
        oracle.assert_within_spec(out, oracle.attn_dist_oracle(q, k, idx, lse, **kw))
        check_output(out, idx, lse, kw, N)
        o = np.asarray(out)
        np.testing.assert_array_equal(o[:, :, 8:12], o[:, :, 12:16])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_lse(bad):
    S, H, D, N, T = 8, 128, 576, 64, 64
    q, k, idx, lse, kw = make_inputs(seed_of("gpu-lse", str(bad)), S=S, H=H, D=D, N=N, T=T, causal=False, index_low=0, index_high=N)
    lse = np.asarray(lse).copy()
    lse[1, :] = bad
    lse[2, 70] = bad
    lse[3, :64] = bad
    lse = jnp.asarray(lse)
    out = np.asarray(kernel(q, k, idx, lse, kw))
    assert np.all(np.isfinite(out))
    assert np.all(out[:, 1] == 0.0)
    assert np.all(out[0, 3] == 0.0)
    oracle.assert_within_spec(out, oracle.attn_dist_oracle(q, k, idx, lse, **kw))


def test_empty_problems_launch_nothing():
    for S, T in [(0, 64), (8, 0)]:
        q = jnp.zeros((S, 64, 576), jnp.bfloat16)
        k = jnp.zeros((16, 1, 576), jnp.bfloat16)
        idx = jnp.zeros((S, 1, T), jnp.int32)
        lse = jnp.zeros((S, 64), jnp.float32)
        out = jax_attn_dist.attn_dist(q, k, idx, lse, lse_base="2", sm_scale=0.1, implementation="cuda")
        assert out.shape == (1, S, T)


# ----------------------------------------------------------------------------
# 64-bit offsets
# ----------------------------------------------------------------------------


def test_large_indices_and_offsets():
    """Keys far into a large k (B * N * D > 2**31 elements): offsets must not
    overflow. Non-causal, so the oracle can run on the gathered rows only."""
    B, S, H, D, T = 3, 8, 64, 576, 64
    N = 2**21  # B * N * D = 3.6e9 elements (7.2 GB bf16)
    key = jax.random.key(5)
    k = jax.random.normal(key, (B, N, 1, D), jnp.float32).astype(BF16)
    rng = np.random.default_rng(seed_of("gpu-large"))
    idx = rng.integers(N - 1000, N + 3, (B, S, 1, T))
    idx[..., :4] = [N - 1, N, INT32_MAX, 0]
    q = jnp.asarray(rng.standard_normal((B, S, H, D)), BF16)
    idx_j = jnp.asarray(idx, jnp.int32)
    # compact problem with the same z for the oracle
    valid = (idx >= 0) & (idx < N)
    used = np.unique(np.where(valid, idx, N - 1))
    remap = np.full(idx.shape, -1, np.int64)
    remap[valid] = np.searchsorted(used, idx[valid])
    k_small = np.asarray(k[:, used])  # [B, U, 1, D]
    kw = dict(sm_scale=0.05, causal=False, q_start_index=0, k_stride=1, lse_base="e")
    lse = oracle.exact_lse(q, k_small, remap, **kw).astype(np.float32)
    want = oracle.attn_dist_oracle(q, k_small, remap, lse, **kw)
    out = kernel(q, k, idx_j, jnp.asarray(lse), kw)
    oracle.assert_within_spec(out, want)
    check_output(out, idx_j, lse, kw, N)


@pytest.mark.skipif("not config.getoption('--run-large')", reason="needs --run-large (4.4 GB K)")
def test_k_larger_than_2_pow_31_elements():
    """K of N = 3.8M rows x 576 (2.19e9 elements): 64-bit row offsets."""
    N, D, S, H, T = 3_800_000, 576, 4, 64, 256
    assert N * D > 2**31
    rng = np.random.default_rng(5)
    k = jax.random.normal(jax.random.key(0), (1, N, 1, D), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((1, S, H, D)).astype(np.float32), jnp.bfloat16)
    idx = rng.integers(N - 2000, N + 3, (1, S, 1, T)).astype(np.int64)
    idx[..., :4] = [N - 1, N, checks.INT32_MAX, checks.INT32_MIN]
    idx = idx.astype(np.int32)
    # Oracle on the gathered rows only (a local K), remapping valid indices.
    uniq = np.unique(idx[(idx >= 0) & (idx < N)])
    k_local = np.asarray(k[0, uniq])[None]
    local = np.full(idx.shape, -1, np.int32)
    ok = (idx >= 0) & (idx < N)
    local[ok] = np.searchsorted(uniq, idx[ok])
    kw = dict(sm_scale=D**-0.5, causal=False, k_stride=1, lse_base="2")
    lse = oracle.exact_lse(q, k_local, local, q_start_index=np.zeros(1, np.int32), **kw).astype(np.float32)
    out = run_kernel((q, k, idx, lse, np.zeros(1, np.int32)), dict(kw, q_start_index=0))
    ref = oracle.attn_dist_oracle(q, k_local, local, lse, q_start_index=0, **kw)
    oracle.assert_within_spec(out, ref)
    assert (out[..., 1:4] == 0).all()


# ----------------------------------------------------------------------------
# the FFI handler's own checks
# ----------------------------------------------------------------------------


def _raw_ffi(q_shape, k_shape, idx_shape, lse_shape, qs_shape, out_shape, *, ranges_shape=None, sm_scale=0.1,
             k_stride=1):
    """The FFI target called directly, bypassing the Python checks."""
    if ranges_shape is None:
        ranges_shape = q_shape[:2] + (0,)
    args = (jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16), jnp.zeros(idx_shape, jnp.int32),
            jnp.zeros(lse_shape, jnp.float32), jnp.zeros(qs_shape, jnp.int32), jnp.zeros(ranges_shape, jnp.int32))
    call = jax.ffi.ffi_call(attn_contract.FFI_TARGET, jax.ShapeDtypeStruct(out_shape, jnp.float32))
    return jax.block_until_ready(jax.jit(lambda *a: call(*a, sm_scale=np.float32(sm_scale), causal=True,
                                                         k_stride=np.int32(k_stride), lse_base_e=False))(*args))


GOOD = dict(q_shape=(1, 4, 64, 576), k_shape=(1, 32, 1, 576), idx_shape=(1, 4, 1, 64), lse_shape=(1, 4, 64),
            qs_shape=(1,), out_shape=(1, 1, 4, 64))
BAD = {
    "D=128": (dict(q_shape=(1, 4, 64, 128), k_shape=(1, 32, 1, 128)), "head dim D must be 512 or 576"),
    "HK=2": (dict(k_shape=(1, 32, 2, 576)), "k must have shape"),
    "q rank 3": (dict(q_shape=(4, 64, 576)), "q must be rank 4"),
    "indices S": (dict(idx_shape=(1, 5, 1, 64)), "indices must have shape"),
    "lse H": (dict(lse_shape=(1, 4, 32)), "lse must have shape"),
    "q_start B": (dict(qs_shape=(2,)), "q_start must have shape"),
    "row_ranges fields": (dict(ranges_shape=(1, 4, 2)),
                          r"row_ranges must have shape \[B, S, 3\] = \[1, 4, 3\], or \[B, S, 0\] for none, got \[1, 4, 2\]"),
    "row_ranges S": (dict(ranges_shape=(1, 5, 3)), r"row_ranges must have shape \[B, S, 3\]"),
    "out G": (dict(out_shape=(1, 2, 4, 64)), "out must have shape"),
    "k_stride 0": (dict(k_stride=0), "k_stride must be >= 1"),
    "sm_scale nan": (dict(sm_scale=float("nan")), "sm_scale must be finite"),
}


def test_ffi_handler_accepts_good_call():
    assert _raw_ffi(**GOOD).shape == GOOD["out_shape"]
    # All-zero row ranges: the empty key range and no live slot, so all zeros.
    out = _raw_ffi(**GOOD, ranges_shape=(1, 4, 3))
    assert out.shape == GOOD["out_shape"] and not np.asarray(out).any()


@pytest.mark.parametrize("name", list(BAD))
def test_ffi_handler_returns_clear_errors(name):
    """The handler re-validates and returns an ffi::Error (the process lives on)."""
    change, message = BAD[name]
    with pytest.raises(Exception, match=message):
        _raw_ffi(**{**GOOD, **change})
