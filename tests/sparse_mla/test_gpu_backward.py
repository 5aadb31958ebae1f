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
q_start; both modes, with bitwise-identical repeats in the deterministic one.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from inputs import require_ffi_targets, seed_of
from jax_attn_dist import oracle
from jax_attn_dist.ops.sparse_mla.contract import BWD_FFI_TARGET
from sparse_mla_cases import check_grads, check_sharded_steps, cotangents, grads, make_sparse_mla_inputs

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
