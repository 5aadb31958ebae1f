"""Run a few kernel cases for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    compute-sanitizer --tool racecheck --kernel-name kns=attn_dist_kernel python tests/sanitizer_run.py

Covers partial T, partial H, both head tiles, both D, batched, all-invalid.
Exits non-zero if a result is wrong.
"""

import sys

from kernel_cases import Case, check_case

CASES = [
    Case(S=2, H=128, T=2048, D=576, N=3000, invalid_fraction=0.3, seed=1),           # full blocks, 2 groups
    Case(S=3, H=96, T=200, D=576, N=500, B=3, per_batch_q_start=True, seed=2),       # partial H and T, batched
    Case(S=2, H=16, T=65, D=512, N=100, k_stride=4, lse_base="e", seed=3),           # tiny H, one slot past a block
    Case(S=2, H=64, T=2049, D=512, N=5000, causal=False, seed=4),                    # 64-head tile, T odd
    Case(S=4, H=1, T=1, D=576, N=10, B=1, seed=5),                                   # minimal
    Case(S=2, H=192, T=127, D=576, N=300, invalid_fraction=1.0, seed=6),             # 2 head tiles, all invalid
    Case(S=64, H=128, T=512, D=576, N=8192, invalid_fraction=0.1, seed=7),           # mid-size
]

if __name__ == "__main__":
    for case in CASES:
        check_case(case)
        print("ok", case.name, flush=True)
    sys.exit(0)
