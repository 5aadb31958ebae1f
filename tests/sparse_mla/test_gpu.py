"""sparse_mla's SM90 forward kernel against the float64 oracle (SPEC §8.2), on
the GPU (skipped elsewhere, see conftest.py; a built extension without this
op's FFI target skips too, or fails under JAX_ATTN_DIST_REQUIRE_GPU).

Unwritten outputs are caught here by running every case twice on different
inputs of the same shapes (the same XLA buffers are likely to be reused),
each result matching its own inputs' oracle; test_gpu_poisoned.py runs the
kernels through their test-only FFI twins into poisoned buffers. Covered: head
counts 1, 64, 65, 128, 200; T 1, 63, 65, 2048; D 512 and 576; both lse
bases; adversarial indices and rows with no valid slot (out exactly 0, lse
-inf); packed rows with topk_length; batches with per-batch q_start;
bitwise determinism; gradients through the forward and backward kernels
(within SPEC §8.3's limits; huge and non-finite dlse on rows with no valid
slot); per-batch q_start at the int32 limits; the packed cases of
packed_cases.py, malformed boundaries (SPEC §6.3) included; raw adversarial
row ranges through the primitive (as packing/test_gpu.py does for the other
ops).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import require_ffi_targets, seed_of
from jax_attn_dist import oracle, sparse_mla
from jax_attn_dist.ops.sparse_mla.contract import FFI_TARGET
from packed_cases import CASES as PACKED_CASES
from sparse_mla_cases import (check_against_oracle, check_grads, cotangents, grads, make_int32_limit_inputs,
                              make_sparse_mla_inputs, oracle_kwargs, packed_case_has_rows, packed_case_inputs,
                              raw_row_ranges_forward, raw_row_ranges_inputs, run)

pytestmark = pytest.mark.gpu

BF16 = jnp.bfloat16
OUT_TOL = oracle.SPARSE_MLA_OUT_TOLERANCE
LSE_TOL = oracle.SPARSE_MLA_LSE_TOLERANCE


@pytest.fixture(autouse=True)
def _needs_this_kernel():
    """The extension may predate this op: its FFI target must be registered."""
    require_ffi_targets(FFI_TARGET)


def kernel(q, kv, idx, kw, **extra):
    """sparse_mla forced onto the kernel, under jit, array keywords traced."""
    return run(q, kv, idx, dict(kw, implementation="cuda"), **extra)


def check_twice(make, **packing):
    """Two draws of the same shapes through the kernel, each checked against
    its own oracle (a stale or unwritten output fails one of them)."""
    results = []
    for draw in range(2):
        q, kv, idx, kw = make(draw)
        out, lse = kernel(q, kv, idx, kw, **packing)
        assert out.dtype == BF16 and lse.dtype == jnp.float32
        check_against_oracle(q, kv, idx, kw, out, lse, out_tol=OUT_TOL, lse_tol=LSE_TOL, **packing)
        results.append(np.asarray(out, np.float32))
    assert not np.array_equal(results[0], results[1])
    return results


CASES = [  # (H, T, D, S, N)
    (1, 1, 576, 16, 300), (64, 63, 576, 16, 300), (65, 65, 512, 16, 300), (128, 2048, 576, 8, 4096),
    (200, 65, 576, 8, 300), (128, 63, 512, 16, 300), (64, 2048, 512, 8, 4096), (1, 65, 512, 5, 100),
    # an odd number of key blocks past the first pair: the last pair has no odd block
    (64, 130, 576, 16, 300), (64, 257, 512, 8, 600), (128, 4097, 576, 4, 8192),
]


@pytest.mark.parametrize("H,T,D,S,N", CASES, ids=[f"H{c[0]}-T{c[1]}-D{c[2]}" for c in CASES])
def test_matches_float64(H, T, D, S, N):
    check_twice(lambda draw: make_sparse_mla_inputs(seed_of("gpu", H, T, D, draw), S=S, H=H, D=D, N=N, T=T,
                                                    d_v=512, lse_base="2" if draw else "e", invalid_fraction=0.2))


@pytest.mark.parametrize("causal,k_stride", [(True, 1), (True, 4), (False, 1)])
def test_batch_per_batch_q_start(causal, k_stride):
    check_twice(lambda draw: make_sparse_mla_inputs(seed_of("gpu-batch", causal, k_stride, draw), B=3, S=40, H=128,
                                                    D=576, N=200, T=128, causal=causal, k_stride=k_stride,
                                                    q_start_index="batch", empty_rows=0.1))


def test_adversarial_indices_and_empty_rows():
    """INT32_MIN/MAX, -1, N, duplicates; rows of no valid slot: out exactly 0
    and lse -inf; duplicated slots weigh twice."""
    def make(draw):
        return make_sparse_mla_inputs(seed_of("gpu-adv", draw), S=32, H=65, D=576, N=150, T=96, causal=bool(draw),
                                      invalid_fraction=0.5, empty_rows=0.2)

    check_twice(make)
    q, kv, idx, kw = make(0)
    out, lse = kernel(q, kv, jnp.full(idx.shape, -1, jnp.int32), kw)
    assert np.all(np.asarray(out, np.float32) == 0.0) and np.isneginf(np.asarray(lse)).all()


def test_packed_rows_and_topk_length():
    S, N, T = 48, 96, 80
    rng = np.random.default_rng(seed_of("gpu-packed"))
    packing = dict(cu_seqlens_q=jnp.asarray([0, 10, 30, 44], jnp.int32),
                   cu_seqlens_k=jnp.asarray([0, 20, 70, 96], jnp.int32),
                   topk_length=jnp.asarray(rng.integers(-3, T + 10, (S,)), jnp.int32))

    def make(draw):
        q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-packed", draw), S=S, H=64, D=512, N=N, T=T,
                                                indices="uniform")
        return q, kv, idx, dict(kw, q_start_index=jnp.asarray([0, 5, 2], jnp.int32))

    check_twice(make, **packing)


def test_bitwise_deterministic_and_deterministic_flag():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-det"), B=2, S=128, H=128, D=576, N=4096, T=2048,
                                            q_start_index="batch", invalid_fraction=0.1)
    a = kernel(q, kv, idx, kw)
    for det in (False, True, False):
        b = kernel(q, kv, idx, kw, deterministic=det)
        for x, y in zip(a, b):
            assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_kernel_is_default_on_gpu_and_agrees_with_xla_path():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-default"), S=16, H=64, D=576, N=300, T=128)
    f = lambda q, kv, i: sparse_mla(q, kv, i, **kw)  # noqa: E731
    assert FFI_TARGET in jax.jit(f).lower(q, kv, idx).as_text()
    out, lse = jax.jit(f)(q, kv, idx)
    xo, xl = jax.jit(lambda q, kv, i: sparse_mla(q, kv, i, implementation="xla", **kw))(q, kv, idx)
    rel, mx = oracle.spec_errors(np.asarray(out, np.float32), np.asarray(xo, np.float32))
    assert rel <= OUT_TOL and mx <= OUT_TOL
    finite = np.isfinite(np.asarray(xl))
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), ~finite)
    assert np.abs(np.asarray(lse)[finite] - np.asarray(xl)[finite]).max() <= LSE_TOL


#: dlse values put on head rows with no valid slot: SPEC §8.3 promises zero
#: gradients there, never NaN, "whatever dlse holds there".
WILD_DLSE = np.array([1e4, -1e4, 1e30, -1e30, np.inf, -np.inf, np.nan], np.float32)


def wild_dlse_on_empty_rows(dlse, ref_lse):
    """(dlse with WILD_DLSE on the heads whose oracle lse is -inf, the same
    with 0 there: the cotangent the float64 gradients are formed from)."""
    empty = np.isneginf(ref_lse)
    wild = WILD_DLSE[np.arange(empty.size).reshape(empty.shape) % len(WILD_DLSE)]
    dlse = np.asarray(dlse, np.float32)
    return jnp.asarray(np.where(empty, wild, dlse)), jnp.asarray(np.where(empty, 0.0, dlse).astype(np.float32))


@pytest.mark.parametrize("deterministic,lse_base", [(False, "2"), (True, "e"), (True, "2")])
def test_gradients_through_the_kernels(deterministic, lse_base):
    """The forward kernel and the backward kernel (which implementation="cuda"
    leaves to None, so it runs where it applies): gradients within SPEC
    §8.3's limits of the float64 ones (check_grads), with dlse of 1e4, 1e30,
    +-inf and NaN on the rows with no valid slot, which must get exactly
    zero gradients (the float64 ones are formed with dlse 0 there)."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-grad", deterministic, lse_base), B=2, S=16, H=64, D=576,
                                            N=200, T=64, lse_base=lse_base, q_start_index="batch", empty_rows=0.2)
    _, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **oracle_kwargs(kw))
    assert np.isneginf(ref_lse).any() and np.isfinite(ref_lse).any()
    dout, dlse = cotangents(seed_of("gpu-grad-cot", deterministic, lse_base), q)
    wild, zeroed = wild_dlse_on_empty_rows(dlse, ref_lse)
    dq, dkv = grads(q, kv, idx, kw, dout, wild, deterministic=deterministic)
    check_grads(q, kv, idx, kw, dout, zeroed, dq, dkv)
    assert np.all(np.asarray(dq, np.float32)[np.isneginf(ref_lse)] == 0)


@pytest.mark.parametrize("k_stride", [1, 4])
def test_q_start_at_int32_limits(k_stride):
    """Per-batch q_start INT32_MIN, INT32_MIN + 3, INT32_MAX - 5, INT32_MAX
    (SPEC §6.2: exact for every int32 value): the first two elements see no
    key (out 0, lse -inf), the last two every key in range."""
    def make(draw):
        return make_int32_limit_inputs(seed_of("gpu-int32-limits", k_stride, draw), S=24, H=64, D=576, N=200, T=96,
                                       k_stride=k_stride, invalid_fraction=0.2)

    q, kv, idx, kw = make(0)
    _, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **oracle_kwargs(kw))
    assert np.isneginf(ref_lse[:2]).all() and np.isfinite(ref_lse[2:]).mean() > 0.5
    check_twice(make)


PACKED_ROWS = [c for c in PACKED_CASES if c.get("HK", 1) == 1 and packed_case_has_rows(c)]
PACKED_NO_ROWS = [c for c in PACKED_CASES if c.get("HK", 1) == 1 and not packed_case_has_rows(c)]


@pytest.mark.parametrize("case", PACKED_ROWS, ids=[c["name"] for c in PACKED_ROWS])
def test_packed_cases_and_malformed_boundaries(case):
    """The packed cases of packed_cases.py through the kernel: several
    sequences, k_stride, q_start at the int32 extremes, topk_length, and
    SPEC §6.3's malformed boundaries (decreasing, negative, past S or N):
    no error, the rows they touch give 0 and -inf (the oracle's -inf rows,
    which check_against_oracle requires exactly), the rest the oracle."""
    from packed_cases import packing_kwargs

    check_twice(lambda draw: packed_case_inputs(case, seed_of("gpu-packed-case", case["name"], draw), H=64, D=576,
                                                lse_base="e" if draw else "2")[:4], **packing_kwargs(case))


@pytest.mark.parametrize("case", PACKED_NO_ROWS, ids=[c["name"] for c in PACKED_NO_ROWS])
def test_packed_cases_where_no_row_has_a_sequence(case):
    q, kv, idx, kw, packing = packed_case_inputs(case, seed_of("gpu-packed-none", case["name"]), H=64, D=576)
    out, lse = kernel(q, kv, idx, kw, **packing)
    assert np.all(np.asarray(out, np.float32) == 0) and np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("H,D,S,B,N,T,far", [
    (64, 576, 48, 2, 300, 200, False), (128, 512, 48, 2, 300, 200, False), (65, 576, 130, 1, 300, 130, False),
    (64, 576, 64, 1, 37, 96, True), (128, 576, 64, 2, 100, 96, True),
])
def test_raw_row_ranges(H, D, S, B, N, T, far):
    """The forward kernel on raw row ranges (the primitive's operand, SPEC
    §6: key_begin, key_end, topk_length), adversarial as in
    packed_kernel_cases (negative, past N or T, end < begin, int32 extremes;
    far: far past N and below 0): out and lse are the float64 oracle's on
    the indices the clamp rule leaves valid; the same bits twice."""
    operands, params, masked, okw = raw_row_ranges_inputs(seed_of("gpu-raw-ranges", H, D, S, B, N, T, far), B=B,
                                                          S=S, H=H, D=D, N=N, T=T, far=far)
    out, lse, text = raw_row_ranges_forward(operands, params, implementation="cuda")
    assert FFI_TARGET in text
    assert out.dtype == BF16 and lse.dtype == jnp.float32
    check_against_oracle(operands[0], operands[1], masked, okw, out, lse, out_tol=OUT_TOL, lse_tol=LSE_TOL)
    again = raw_row_ranges_forward(operands, params, implementation="cuda")[:2]
    for x, y in zip((out, lse), again):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
