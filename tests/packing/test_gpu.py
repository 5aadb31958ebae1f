"""SPEC §6 (packed sequences, per-row top-k lengths) on the CUDA kernels:
the §6 keywords become per-row ranges in XLA (packing.row_ranges) and the
SM90 kernels apply them per row, skipping the blocks past topk_length
(implementation="cuda"), against the float64 oracle's independent reading of
§6; and the kernels on raw, adversarial ranges into poisoned outputs
(support/packed_kernel_cases.py, which sanitizer_run.py runs under
compute-sanitizer too). GPU only (see conftest.py); the jnp path's tests are
test_packed.py and test_row_ranges.py."""

from __future__ import annotations

import pytest

from packed_kernel_cases import (GPU_CASES, check_attn_dist_kernel_on_packed_inputs,
                                 check_attn_dist_kernel_on_raw_row_ranges, check_calls_without_row_ranges,
                                 check_indexer_kernels_on_packed_inputs, check_indexer_kernels_on_raw_row_ranges)

pytestmark = pytest.mark.gpu

IDS = [c["name"] for c in GPU_CASES]


@pytest.mark.parametrize("case", GPU_CASES, ids=IDS)
def test_attn_dist_kernel_on_packed_inputs(case):
    check_attn_dist_kernel_on_packed_inputs(case)


@pytest.mark.parametrize("case", GPU_CASES, ids=IDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_indexer_kernels_on_packed_inputs(case, deterministic):
    check_indexer_kernels_on_packed_inputs(case, deterministic)


@pytest.mark.parametrize("H,D,S", [(64, 576, 48), (128, 576, 48), (130, 512, 48),
                                   (64, 576, 600), (96, 512, 600), (130, 576, 300)])
def test_attn_dist_kernel_on_raw_row_ranges(H, D, S):
    """H = 64 and 128 are the two head tiles (128: two groups per tile); 130
    adds a partial group in a second tile. S = 48 gives fewer CTAs than an
    H100 has SMs; 1200 give several waves, each SM going through rows with
    no live block, one block (the second consumer idle) and several (and,
    for H > 64, each CTA's L2 prefetch of its successor's rows)."""
    check_attn_dist_kernel_on_raw_row_ranges(H, D, S)


@pytest.mark.parametrize("HI,DI", [(64, 128), (16, 64)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_indexer_kernels_on_raw_row_ranges(deterministic, HI, DI):
    check_indexer_kernels_on_raw_row_ranges(deterministic, HI, DI)


@pytest.mark.parametrize("H,D,B,N", [(64, 576, 1, 37), (130, 512, 1, 300), (128, 576, 2, 100)])
def test_attn_dist_kernel_on_far_row_ranges(H, D, B, N):
    """Key ranges far past N, below 0 and inverted, lengths far past T or
    negative, indices inside those ranges but past N (sanitizer_run.py's
    ranges mode runs these under memcheck)."""
    check_attn_dist_kernel_on_raw_row_ranges(H, D, 64, B=B, N=N, far=True)


@pytest.mark.parametrize("HI,DI,B,N", [(64, 128, 1, 37), (16, 64, 2, 100)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_indexer_kernels_on_far_row_ranges(deterministic, HI, DI, B, N):
    check_indexer_kernels_on_raw_row_ranges(deterministic, HI, DI, B=B, N=N, far=True)


def test_calls_without_row_ranges_still_run():
    check_calls_without_row_ranges()
