"""sparse_mla's forward and backward kernels writing into NaN-filled outputs
(the test-only FFI twins; GPU only, skipped elsewhere, see conftest.py; an
extension built without the test targets skips too, or fails under
JAX_ATTN_DIST_REQUIRE_GPU): out, lse, dq and dkv have every element written
and meet SPEC §8.2 / §8.3 against the float64 oracle, with exact zeros on
rows and keys no valid slot reaches. Covered: partial head tiles (H 65,
200), T not a multiple of 64, D 512 and 576, both lse bases, per-batch
q_start whose first rows see no key, rows of no valid slot, adversarial and
duplicate indices, k_stride > 1, both backward modes."""

from __future__ import annotations

import pytest

from inputs import require_ffi_targets, seed_of
from jax_attn_dist import oracle
from jax_attn_dist.ops.sparse_mla import contract
from sparse_mla_cases import cotangents, make_sparse_mla_inputs
from sparse_mla_poisoned import check_forward_and_backward

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_the_twins():
    require_ffi_targets(contract.FFI_TEST_TARGET, contract.BWD_FFI_TEST_TARGET)


CASES = [  # (H, T, D, S, N, k_stride, lse_base)
    (65, 65, 576, 24, 300, 1, "e"),
    (128, 200, 512, 16, 500, 1, "2"),
    (200, 130, 576, 8, 400, 4, "2"),
    (1, 1, 576, 12, 50, 1, "e"),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["float32", "deterministic"])
@pytest.mark.parametrize("H,T,D,S,N,k_stride,lse_base", CASES, ids=[f"H{c[0]}-T{c[1]}-D{c[2]}" for c in CASES])
def test_every_output_element_written(H, T, D, S, N, k_stride, lse_base, deterministic):
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("gpu-poisoned", H, T, D), B=2, S=S, H=H, D=D, N=N, T=T,
                                            d_v=512, k_stride=k_stride, lse_base=lse_base, q_start_index="batch",
                                            invalid_fraction=0.3, empty_rows=0.15)
    dout, dlse = cotangents(seed_of("gpu-poisoned-cot", H, T, D), q)
    check_forward_and_backward(q, kv, idx, kw, dout, dlse, out_tol=oracle.SPARSE_MLA_OUT_TOLERANCE,
                               lse_tol=oracle.SPARSE_MLA_LSE_TOLERANCE, deterministic=deterministic)
