"""Run a few kernel cases for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    compute-sanitizer --tool racecheck --kernel-name kns=attn_dist_kernel python tests/sanitizer_run.py attn_dist
    compute-sanitizer --tool racecheck --kernel-name kns=indexer_fwd_kernel python tests/sanitizer_run.py indexer
    compute-sanitizer --tool racecheck --kernel-name kns=indexer_bwd_kernel python tests/sanitizer_run.py indexer_bwd
    compute-sanitizer --tool memcheck python tests/sanitizer_run.py indexer_bwd_det
    compute-sanitizer --tool memcheck python tests/sanitizer_run.py packed

attn_dist: partial T, partial H, both head tiles, both D, batched, all-invalid.
indexer: every head-tile variant (16, 32, 64, 4 x 64), both DI, partial T,
batched, all-invalid, T = 0. indexer_bwd: the backward kernel on the
indexer cases it serves (HI <= 64) plus hot duplicated keys; indexer_bwd_det:
the same cases in deterministic mode (its row-bound, main and conversion
kernels). packed: SPEC §6 on all three kernels (test_packed_gpu.py's
checks): raw adversarial row ranges (out-of-range and inverted key ranges,
lengths of 0, on block edges and past T) and packed calls with malformed
cu_seqlens (decreasing, past S or N, int32 extremes), no sequences, and
per-row topk_length (rows with no live block). Exits non-zero if a result
is wrong.
"""

import functools
import sys

import indexer_cases
import kernel_cases

ATTN_DIST = [
    kernel_cases.Case(S=2, H=128, T=2048, D=576, N=3000, invalid_fraction=0.3, seed=1),   # full blocks, 2 groups
    kernel_cases.Case(S=3, H=96, T=200, D=576, N=500, B=3, per_batch_q_start=True, seed=2),  # 96-head tile, batched
    kernel_cases.Case(S=2, H=16, T=65, D=512, N=100, k_stride=4, lse_base="e", seed=3),   # tiny H, one slot past
    kernel_cases.Case(S=2, H=64, T=2049, D=512, N=5000, causal=False, seed=4),            # 64-head tile, T odd
    kernel_cases.Case(S=4, H=1, T=1, D=576, N=10, B=1, seed=5),                           # minimal
    kernel_cases.Case(S=2, H=192, T=127, D=576, N=300, invalid_fraction=1.0, seed=6),     # 2 head tiles, all invalid
    kernel_cases.Case(S=64, H=128, T=512, D=576, N=8192, invalid_fraction=0.1, seed=7),   # mid-size
    # More CTAs than SMs, so each asks L2 for its successor's rows (HT = 128
    # with a partial second head tile, across the batch boundary).
    kernel_cases.Case(S=150, H=160, T=130, D=576, N=700, B=2, per_batch_q_start=True, seed=8),
    # The 96-head tile with a partial second group, more CTAs than SMs.
    kernel_cases.Case(S=300, H=72, T=200, D=512, N=900, causal=False, seed=9),
]

INDEXER = [
    indexer_cases.Case(S=3, HI=64, T=2048, DI=128, N=8192, invalid_fraction=0.1, seed=1),  # V3.2's shape, full T
    indexer_cases.Case(S=4, HI=16, T=200, DI=64, N=300, B=3, per_batch_q_start=True, seed=2),  # HT 16, batched
    indexer_cases.Case(S=3, HI=20, T=65, DI=128, N=100, k_stride=4, seed=3),              # HT 32, partial heads
    indexer_cases.Case(S=2, HI=200, T=129, DI=128, N=500, causal=False, seed=4),           # 4 head tiles of 64
    indexer_cases.Case(S=2, HI=64, T=64, DI=64, N=50, invalid_fraction=1.0, seed=5),      # all invalid
    indexer_cases.Case(S=3, HI=1, T=0, DI=128, N=10, seed=6),                             # T = 0
    indexer_cases.Case(S=48, HI=64, T=512, DI=128, N=4096, seed=7),                       # mid-size
    # More rows than resident CTAs (396 and 264 on an H100): CTAs prefetch
    # their successors' rows, across a batch boundary and past the last row.
    indexer_cases.Case(S=500, HI=64, T=130, DI=128, N=600, B=2, per_batch_q_start=True, invalid_fraction=0.3, seed=8),
    indexer_cases.Case(S=300, HI=130, T=70, DI=64, N=200, seed=9),
]

INDEXER_BWD = [c for c in INDEXER if c.HI <= 64] + [
    indexer_cases.Case(S=16, HI=32, T=256, DI=64, N=4, causal=False, invalid_fraction=0.0, seed=8),  # hot duplicates
]

class Named:
    """A named check without arguments (the packed mode's test functions)."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn


def packed_checks():
    import test_packed_gpu as t
    from test_packed import CASES

    checks = [Named("raw-ranges-attn_dist-h64",
                    functools.partial(t.test_attn_dist_kernel_on_raw_row_ranges, 64, 576, 48)),
              Named("raw-ranges-attn_dist-h130-d512",
                    functools.partial(t.test_attn_dist_kernel_on_raw_row_ranges, 130, 512, 48)),
              # Several waves of CTAs (1200): rows with no, one and several blocks on each SM.
              Named("raw-ranges-attn_dist-h64-waves",
                    functools.partial(t.test_attn_dist_kernel_on_raw_row_ranges, 64, 576, 600)),
              Named("raw-ranges-indexer", functools.partial(t.test_indexer_kernels_on_raw_row_ranges, False, 64, 128)),
              Named("raw-ranges-indexer-det-h16",
                    functools.partial(t.test_indexer_kernels_on_raw_row_ranges, True, 16, 64)),
              Named("no-row-ranges", t.test_calls_without_row_ranges_still_run)]
    for case in CASES:
        if case["name"] in ("bad-decreasing-q", "bad-k-past-N", "bad-extremes", "no-sequences", "topk-packed"):
            checks.append(Named(f"attn_dist-{case['name']}",
                                functools.partial(t.test_attn_dist_kernel_on_packed_inputs, case)))
            checks.append(Named(f"indexer-{case['name']}",
                                functools.partial(t.test_indexer_kernels_on_packed_inputs, case, False)))
    return checks


CHECKS = {
    "attn_dist": (ATTN_DIST, kernel_cases.check_case),
    "indexer": (INDEXER, indexer_cases.check_case),
    "indexer_bwd": (INDEXER_BWD, indexer_cases.check_bwd_case),
    "indexer_bwd_det": (INDEXER_BWD, functools.partial(indexer_cases.check_bwd_case, deterministic=True)),
    "packed": (None, lambda named: named.fn()),
}

if __name__ == "__main__":
    which = sys.argv[1:] or list(CHECKS)
    for name in which:
        cases, check = CHECKS[name]
        for case in cases if cases is not None else packed_checks():
            check(case)
            print("ok", name, case.name, flush=True)
    sys.exit(0)
