"""How a shape's time grows with the number of query rows (docs/PERFORMANCE.md §27).

attn_dist runs one CTA per (row, head tile), one CTA per SM at a time. If its
time is set by whole waves of CTAs, S = 132 * W + 4 costs as much as
132 * (W + 1), and S = 132 * W costs W / (W + 1) of it. On the device:
  python3 tools/wave_probe.py [--json OUT]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", type=int, nargs="*", default=[3960, 4092, 4096, 4224])
    ap.add_argument("--shapes", nargs="*", default=["v32-h128", "v32-h64"], choices=list(bench.ATTN_SHAPES))
    args = ap.parse_args()
    gemm = bench.gemm_ceiling(10, 15)
    rows = []
    for name in args.shapes:
        _, n, h, t, d = bench.ATTN_SHAPES[name]
        for s in args.rows:
            r = bench.bench_attn_dist(f"{name}-s{s}", (s, n, h, t, d), calls=10, samples=15, gemm_tflops=gemm,
                                      with_xla=False)
            rows.append(r)
            print(f"{r['name']:<18} S={s:5d}  {r['kernel_ms']:.3f} ms  {r['kernel_ms'] / s * 1e3:.3f} us/row", flush=True)
    if args.json:
        json.dump({"gemm_8192_tflops": gemm, "rows": rows}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
