"""sparse_mla's SM90 forward kernel against the float64 oracle (SPEC §8.2), on
the GPU (skipped elsewhere, see conftest.py; a built extension without this
op's FFI target skips too, or fails under JAX_ATTN_DIST_REQUIRE_GPU).

There is no test-only twin of the FFI target that writes into a poisoned
output, so unwritten outputs are caught differently: every case runs twice
on different inputs of the same shapes (the same XLA buffers are likely to
be reused), and each result must match its own inputs' oracle. Covered: head
counts 1, 64, 65, 128, 200; T 1, 63, 65, 2048; D 512 and 576; both lse
bases; adversarial indices and rows with no valid slot (out exactly 0, lse
-inf); packed rows with topk_length; batches with per-batch q_start;
bitwise determinism; gradients through the forward and backward kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import require_ffi_targets, seed_of
from jax_attn_dist import oracle, sparse_mla
from jax_attn_dist.ops.sparse_mla.contract import FFI_TARGET
from sparse_mla_cases import check_against_oracle, make_sparse_mla_inputs, run

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


def test_gradients_through_the_kernels():
    """The forward kernel and the backward kernel (which implementation="cuda"
    leaves to None, so it runs where it applies): gradients within bf16
    accuracy of the float64 ones."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-grad"), S=16, H=64, D=576, N=200, T=64)
    rng = np.random.default_rng(1)
    dout = jnp.asarray(rng.standard_normal((16, 64, 512)), BF16)
    dlse = rng.standard_normal((16, 64)).astype(np.float32)
    _, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **{k: v for k, v in kw.items()})
    dlse = np.where(np.isneginf(ref_lse), 0.0, dlse).astype(np.float32)

    def f(q, kv):
        (out, lse), vjp = jax.vjp(lambda q, kv: sparse_mla(q, kv, idx, implementation="cuda", **kw), q, kv)
        return vjp((dout, jnp.asarray(dlse)))

    dq, dkv = jax.jit(f)(q, kv)
    want = oracle.sparse_mla_grads_oracle(q, kv, idx, np.asarray(dout, np.float32), dlse, **kw)
    for name, got, ref in (("dq", dq, want[0]), ("dkv", dkv, want[1])):
        rel, mx = oracle.spec_errors(np.asarray(got, np.float32), ref)
        assert rel <= 2e-2 and mx <= 2e-2, f"{name}: rel {rel:.2e}, max {mx:.2e}"
