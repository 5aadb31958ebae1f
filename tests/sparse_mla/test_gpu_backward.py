"""sparse_mla's SM90 backward kernels against the float64 gradient oracle
(SPEC §8.3), on the GPU (skipped elsewhere, see conftest.py; a built
extension without the backward's FFI target skips too, or fails under
JAX_ATTN_DIST_REQUIRE_GPU).

Every case runs on two draws of the same shapes, each checked against its
own oracle (a stale or unwritten gradient fails one of them). The
gradients' relative Frobenius error must be <= 5e-3 (dS and P are rounded
to bf16 for the GEMMs, dq and dkv to bf16 at the end). Covered: head counts
1, 64, 65, 128, 200; T 1, 63, 65, 2048; D 512 and 576; both lse bases with
lse cotangents; adversarial and duplicate indices; rows with no valid slot
(zero gradients); packed rows with topk_length; batches with per-batch
q_start, at the int32 limits too; the packed cases of packed_cases.py,
malformed boundaries (SPEC §6.3) included; raw adversarial row ranges
through the primitive; both modes, with bitwise-identical repeats in the
deterministic one; and, in the deterministic mode, an lse other than the
forward's (SPEC §8.3: that batch element's dkv all NaN, the others' bits
unchanged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import require_ffi_targets, seed_of
from jax_attn_dist import oracle
from jax_attn_dist._core import checks
from jax_attn_dist.ops.sparse_mla.contract import BWD_FFI_TARGET
from packed_cases import CASES as PACKED_CASES
from sparse_mla_cases import (check_grads, check_sharded_steps, cotangents, grads, make_int32_limit_inputs,
                              make_sparse_mla_inputs, oracle_kwargs, packed_case_has_rows, packed_case_inputs,
                              raw_row_ranges_grads, raw_row_ranges_inputs)

pytestmark = pytest.mark.gpu

BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _needs_this_kernel():
    """The extension may predate the backward: its FFI target must be registered."""
    require_ffi_targets(BWD_FFI_TARGET)


def check_twice(make, deterministic=False, **packing):
    results = []
    for draw in range(2):
        q, kv, idx, kw = make(draw)
        dout, dlse = cotangents(seed_of("gpu-bwd-cot", draw, q.shape), q)
        dq, dkv = grads(q, kv, idx, kw, dout, dlse, deterministic=deterministic, **packing)
        check_grads(q, kv, idx, kw, dout, dlse, dq, dkv, **packing)
        results.append(np.asarray(jnp.asarray(dq, jnp.float32)))
    assert not np.array_equal(results[0], results[1])


CASES = [  # (H, T, D, S, N)
    (1, 1, 576, 16, 300), (64, 63, 576, 16, 300), (65, 65, 512, 16, 300), (128, 2048, 576, 4, 4096),
    (200, 65, 576, 8, 300), (128, 63, 512, 16, 300), (64, 2048, 512, 4, 4096),
    (150, 130, 576, 8, 300),  # three head tiles: the unpaired kernel, several CTAs a token
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["float", "det"])
@pytest.mark.parametrize("H,T,D,S,N", CASES, ids=[f"H{c[0]}-T{c[1]}-D{c[2]}" for c in CASES])
def test_matches_float64(H, T, D, S, N, deterministic):
    check_twice(lambda draw: make_sparse_mla_inputs(seed_of("gpu-bwd", H, T, D, draw), S=S, H=H, D=D, N=N, T=T,
                                                    lse_base="2" if draw else "e", invalid_fraction=0.2),
                deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["float", "det"])
def test_adversarial_indices_and_empty_rows(deterministic):
    """INT32_MIN/MAX, -1, N, duplicates (a key twice gets both slots'
    gradients); rows with no valid slot give dq exactly 0."""
    check_twice(lambda draw: make_sparse_mla_inputs(seed_of("gpu-bwd-adv", draw), S=32, H=65, D=576, N=150, T=96,
                                                    causal=bool(draw), invalid_fraction=0.5, empty_rows=0.2),
                deterministic=deterministic)


def test_all_invalid_gives_zero_gradients():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-bwd-none"), S=8, H=64, D=576, N=100, T=64)
    dout, dlse = cotangents(seed_of("gpu-bwd-none-cot"), q)
    for det in (False, True):
        dq, dkv = grads(q, kv, jnp.full(idx.shape, -1, jnp.int32), kw, dout, dlse, deterministic=det)
        assert np.all(np.asarray(dq, np.float32) == 0) and np.all(np.asarray(dkv, np.float32) == 0)


def test_packed_rows_and_topk_length():
    S, N, T = 48, 96, 80
    rng = np.random.default_rng(seed_of("gpu-bwd-packed"))
    packing = dict(cu_seqlens_q=jnp.asarray([0, 10, 30, 44], jnp.int32),
                   cu_seqlens_k=jnp.asarray([0, 20, 70, 96], jnp.int32),
                   topk_length=jnp.asarray(rng.integers(-3, T + 10, (S,)), jnp.int32))

    def make(draw):
        q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-bwd-packed", draw), S=S, H=64, D=512, N=N, T=T,
                                                indices="uniform")
        return q, kv, idx, dict(kw, q_start_index=jnp.asarray([0, 5, 2], jnp.int32))

    check_twice(make, **packing)


@pytest.mark.parametrize("causal,k_stride", [(True, 1), (True, 4), (False, 1)])
def test_batch_per_batch_q_start(causal, k_stride):
    check_twice(lambda draw: make_sparse_mla_inputs(seed_of("gpu-bwd-batch", causal, k_stride, draw), B=3, S=24,
                                                    H=128, D=576, N=200, T=128, causal=causal, k_stride=k_stride,
                                                    q_start_index="batch", empty_rows=0.1))


def test_deterministic_is_bitwise_reproducible():
    """The deterministic mode: the same bits on every run (and close to the
    float32-atomics mode)."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-bwd-det"), B=2, S=64, H=128, D=576, N=1024, T=1024,
                                            q_start_index="batch", invalid_fraction=0.1)
    dout, dlse = cotangents(seed_of("gpu-bwd-det-cot"), q)
    first = grads(q, kv, idx, kw, dout, dlse, deterministic=True)
    for _ in range(3):
        again = grads(q, kv, idx, kw, dout, dlse, deterministic=True)
        for x, y in zip(first, again):
            assert np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
    loose = grads(q, kv, idx, kw, dout, dlse, deterministic=False)
    for x, y in zip(first, loose):
        rel, _ = oracle.spec_errors(np.asarray(x, np.float32), np.asarray(y, np.float32))
        assert rel <= 2e-3


def test_deterministic_batch_elements_are_independent():
    """Each batch element has its own fixed-point scale: a batched
    deterministic call gives every element the bits it gets alone, and a
    non-finite kv in one element leaves the others' gradients finite."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-bwd-det-batch"), B=2, S=16, H=64, D=576, N=300, T=128)
    dout, dlse = cotangents(seed_of("gpu-bwd-det-batch-cot"), q)
    dq, dkv = grads(q, kv, idx, kw, dout, dlse, deterministic=True)
    for b in range(2):
        one = grads(q[b:b + 1], kv[b:b + 1], idx[b:b + 1], kw, dout[b:b + 1], dlse[b:b + 1], deterministic=True)
        for x, y in zip((dq[b:b + 1], dkv[b:b + 1]), one):
            assert np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
    # an unselected key row of element 1 set to inf: element 0 is unaffected
    kv_bad = kv.at[1, 299, 0, 0].set(jnp.inf)
    idx_bad = jnp.where(idx == 299, 0, idx)
    dq_a, dkv_a = grads(q, kv, idx_bad, kw, dout, dlse, deterministic=True)
    dq_b, dkv_b = grads(q, kv_bad, idx_bad, kw, dout, dlse, deterministic=True)
    assert np.array_equal(np.asarray(dkv_a[0]).view(np.uint16), np.asarray(dkv_b[0]).view(np.uint16))
    assert np.isnan(np.asarray(dkv_b[1], np.float32)).all()


def test_deterministic_steps_for_sharded_rows_give_the_one_calls_bits():
    """The steps a row-sharded deterministic backward takes per shard, run on
    one GPU with no shard to reduce over, give the one call's bits
    (sparse_mla_cases.check_sharded_steps)."""
    check_sharded_steps(seed_of("gpu-bwd-det-steps"))


@pytest.mark.parametrize("deterministic", [False, True], ids=["float", "det"])
@pytest.mark.parametrize("k_stride", [1, 4])
def test_q_start_at_int32_limits(k_stride, deterministic):
    """Per-batch q_start INT32_MIN, INT32_MIN + 3, INT32_MAX - 5, INT32_MAX
    (SPEC §6.2: exact for every int32 value): the first two elements take
    no gradient (exactly 0), the last two every key in range."""
    def make(draw):
        return make_int32_limit_inputs(seed_of("gpu-bwd-int32-limits", k_stride, draw), S=16, H=64, D=576, N=200,
                                       T=96, k_stride=k_stride, invalid_fraction=0.2)

    q, kv, idx, kw = make(0)
    _, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **oracle_kwargs(kw))
    assert np.isneginf(ref_lse[:2]).all() and np.isfinite(ref_lse[2:]).mean() > 0.5
    check_twice(make, deterministic=deterministic)


PACKED_ROWS = [c for c in PACKED_CASES if c.get("HK", 1) == 1 and packed_case_has_rows(c)]
PACKED_NO_ROWS = [c for c in PACKED_CASES if c.get("HK", 1) == 1 and not packed_case_has_rows(c)]


@pytest.mark.parametrize("deterministic", [False, True], ids=["float", "det"])
@pytest.mark.parametrize("case", PACKED_ROWS, ids=[c["name"] for c in PACKED_ROWS])
def test_packed_cases_and_malformed_boundaries(case, deterministic):
    """The packed cases of packed_cases.py through the kernels, SPEC §6.3's
    malformed boundaries included: the rows they touch take exactly zero
    gradients (check_grads: exact 0 wherever the float64 gradient is 0)."""
    from packed_cases import packing_kwargs

    check_twice(lambda draw: packed_case_inputs(case, seed_of("gpu-bwd-packed-case", case["name"], draw), H=64,
                                                D=576, lse_base="e" if draw else "2")[:4],
                deterministic=deterministic, **packing_kwargs(case))


@pytest.mark.parametrize("case", PACKED_NO_ROWS, ids=[c["name"] for c in PACKED_NO_ROWS])
def test_packed_cases_where_no_row_has_a_sequence(case):
    q, kv, idx, kw, packing = packed_case_inputs(case, seed_of("gpu-bwd-packed-none", case["name"]), H=64, D=576)
    dout, dlse = cotangents(seed_of("gpu-bwd-packed-none-cot", case["name"]), q)
    for det in (False, True):
        dq, dkv = grads(q, kv, idx, kw, dout, dlse, deterministic=det, **packing)
        assert np.all(np.asarray(dq, np.float32) == 0) and np.all(np.asarray(dkv, np.float32) == 0)


@pytest.mark.parametrize("deterministic", [False, True], ids=["float", "det"])
@pytest.mark.parametrize("H,D,S,B,N,T,far", [
    (64, 576, 48, 2, 300, 200, False), (128, 512, 48, 2, 300, 200, False), (65, 576, 130, 1, 300, 130, False),
    (64, 576, 64, 1, 37, 96, True), (128, 576, 64, 2, 100, 96, True),
])
def test_raw_row_ranges(H, D, S, B, N, T, far, deterministic):
    """The backward kernel on raw row ranges (the primitive's operand, SPEC
    §6), adversarial as in packed_kernel_cases: dq and dkv are the float64
    gradients on the indices the clamp rule leaves valid (exactly 0 where
    those give none)."""
    operands, params, masked, okw = raw_row_ranges_inputs(seed_of("gpu-bwd-raw-ranges", H, D, S, B, N, T, far),
                                                          B=B, S=S, H=H, D=D, N=N, T=T, far=far)
    q, kv = operands[:2]
    dout, dlse = cotangents(seed_of("gpu-bwd-raw-ranges-cot", H, D, S, B, N, T, far), q)
    dq, dkv, text = raw_row_ranges_grads(operands, params, dout, dlse, implementation="cuda",
                                         deterministic=deterministic)
    assert BWD_FFI_TARGET in text
    check_grads(q, kv, masked, okw, dout, dlse, dq, dkv)


def _bind_forward_and_backward(q, kv, idx, kw, dout, dlse, *, implementation="cuda"):
    """(out, lse, backward): the forward primitive's results and a jitted
    deterministic backward primitive taking any lse (the custom VJP always
    passes the forward's)."""
    from jax_attn_dist.ops.sparse_mla.primitive import sparse_mla_bwd_p, sparse_mla_p

    B, S = q.shape[:2]
    params = dict(sm_scale=kw["sm_scale"], causal=kw["causal"], k_stride=kw["k_stride"], lse_base=kw["lse_base"],
                  d_v=kw["d_v"], deterministic=True, implementation=implementation)
    q_start = jnp.broadcast_to(jnp.asarray(kw["q_start_index"], jnp.int32), (B,))
    ranges = checks.no_row_ranges(B, S)
    out, lse = jax.jit(lambda q, kv: sparse_mla_p.bind(q, kv, idx, q_start, ranges, **params))(q, kv)
    backward = jax.jit(lambda lse: tuple(sparse_mla_bwd_p.bind(q, kv, idx, q_start, ranges, out, lse, dout, dlse,
                                                               **params)))
    return out, lse, backward


@pytest.mark.parametrize("shift", [40.0, 1000.0], ids=["terms-above-bound", "terms-overflow"])
def test_deterministic_dkv_is_nan_for_an_lse_other_than_the_forwards(shift):
    """SPEC §8.3, deterministic mode: a term above the batch element's bound
    (which only an lse other than the forward's produces) or a non-finite
    one makes all of that element's dkv NaN rather than dropping it; the
    other element, with its own scale, keeps the bits it gets with the
    forward's lse. The lse of one row of element 1 that has valid slots is
    lowered by ``shift`` (base 2): P grows by 2^40 (finite terms far above
    any bound built for P <= 1) or overflows. (SPEC §8.3 promises nothing
    for the float32-atomics mode here.)"""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-bwd-other-lse"), B=2, S=16, H=64, D=576, N=300, T=128,
                                            invalid_fraction=0.1)
    dout, dlse = cotangents(seed_of("gpu-bwd-other-lse-cot"), q)
    _, lse, backward = _bind_forward_and_backward(q, kv, idx, kw, dout, dlse)
    assert BWD_FFI_TARGET in backward.lower(lse).as_text()
    _, dkv = backward(lse)
    dkv = np.asarray(dkv)
    assert np.isfinite(dkv).all() and np.abs(dkv[1]).max() > 0
    full = np.nonzero(np.isfinite(np.asarray(lse)[1]).all(-1))[0]
    assert len(full) > 0
    assert kw["lse_base"] == "2"
    _, dkv_other = backward(lse.at[1, full[len(full) // 2]].add(-shift))
    dkv_other = np.asarray(dkv_other)
    assert np.isnan(dkv_other[1]).all(), "element 1: dkv must be NaN everywhere"
    assert dkv_other[0].tobytes() == dkv[0].tobytes(), "element 0: its bits must not change"
