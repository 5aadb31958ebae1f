"""attn_dist benchmark: CUDA kernel vs the jnp reference under XLA vs a dense GEMM.

SPEC §4: every shape is timed in one process, side by side with (a) the jnp
reference on the same GPU and (b) a dense bf16 8192^3 matmul, the practical
ceiling. FLOPs = 2 * B * S * H * T * D (every slot counted).

Timing: each sample enqueues `--calls` back-to-back launches of one jitted
call (alternating between two input sets, so repeated runs do not just re-read
one buffer from L2) and blocks once; the per-call time of a sample is its wall
time / calls, and the reported figure is the median over `--samples` samples
after warm-up. Host dispatch overlaps device work, so this is device time per
call to within the launch gap.

Memory: XLA's own accounting of each compiled call (temporaries + output), the
device memory each path needs beyond its inputs.

    python benchmarks/bench.py                     # the SPEC §4 shapes + extras
    python benchmarks/bench.py --shapes v32-h128 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

import jax_attn_dist
from jax_attn_dist import synthetic

# name: (S, N, H, T, D). SPEC §4 first, then the partial-H / partial-T shapes.
SHAPES = {
    "v32-h128": (4096, 8192, 128, 2048, 576),
    "v32-h128-long": (4096, 32768, 128, 2048, 576),
    "v32-h128-128k": (4096, 131072, 128, 2048, 576),
    "v32-h64": (4096, 8192, 64, 2048, 576),
    "small": (1024, 4096, 128, 512, 576),
    "h16-t2048": (4096, 8192, 16, 2048, 576),
    "h96-t2048": (4096, 8192, 96, 2048, 576),
    "h16-t2000": (4096, 8192, 16, 2000, 576),
    "h96-t2000": (4096, 8192, 96, 2000, 576),
    "v32-h128-d512": (4096, 8192, 128, 2048, 512),
}


def time_calls(fn, arg_sets, *, calls: int, samples: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    per_call = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call)


def extra_memory_bytes(jitted, *args) -> int | None:
    """Temporaries + output of one compiled call, as XLA accounts them."""
    try:
        m = jitted.lower(*args).compile().memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def gemm_ceiling(calls: int, samples: int) -> float:
    """TFLOP/s of a dense bf16 8192^3 matmul on random data."""
    n = 8192
    ka, kb = jax.random.split(jax.random.key(1))
    sets = [
        (jax.random.normal(ka, (n, n), jnp.bfloat16), jax.random.normal(kb, (n, n), jnp.bfloat16)),
        (jax.random.normal(kb, (n, n), jnp.bfloat16), jax.random.normal(ka, (n, n), jnp.bfloat16)),
    ]
    mm = jax.jit(lambda a, b: a @ b)
    t = time_calls(mm, sets, calls=calls, samples=samples)
    return 2 * n**3 / t / 1e12


def bench_shape(name, dims, *, calls, samples, gemm_tflops, with_xla=True):
    S, N, H, T, D = dims
    probs = [synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=seed) for seed in (0, 1)]
    kw = probs[0].kwargs
    flops = probs[0].flops
    arg_sets = [p.arrays for p in probs]

    kernel = jax.jit(lambda q, k, i, l: jax_attn_dist.attn_dist(q, k, i, l, implementation="cuda", **kw))
    xla = jax.jit(lambda q, k, i, l: jax_attn_dist.attn_dist(q, k, i, l, implementation="xla", **kw))

    row = {"name": name, "S": S, "N": N, "H": H, "T": T, "D": D, "flops": flops}
    out_k = kernel(*arg_sets[0])
    t_k = time_calls(kernel, arg_sets, calls=calls, samples=samples)
    row.update(
        kernel_ms=t_k * 1e3,
        kernel_tflops=flops / t_k / 1e12,
        kernel_frac_gemm=flops / t_k / 1e12 / gemm_tflops,
        kernel_extra_bytes=extra_memory_bytes(kernel, *arg_sets[0]),
        invariant_error=synthetic.invariant_error(out_k, probs[0].lse),
    )
    if with_xla:
        out_x = xla(*arg_sets[0])
        t_x = time_calls(xla, arg_sets, calls=max(1, calls // 2), samples=samples)
        rel, max_abs, max_ref = synthetic.compare(out_k, out_x)
        row.update(
            xla_ms=t_x * 1e3,
            xla_tflops=flops / t_x / 1e12,
            speedup_vs_xla=t_x / t_k,
            xla_extra_bytes=extra_memory_bytes(xla, *arg_sets[0]),
            rel_err_vs_xla=rel,
            max_abs_err_vs_xla=max_abs,
        )
    del probs, arg_sets
    return row


def git_commit() -> str:
    if os.environ.get("JAX_ATTN_DIST_COMMIT"):  # the device copy of the tree has no .git
        return os.environ["JAX_ATTN_DIST_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--calls", type=int, default=10, help="launches per timed sample")
    ap.add_argument("--samples", type=int, default=15, help="timed samples (median reported)")
    ap.add_argument("--no-xla", action="store_true", help="skip the jnp reference")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    if jax.default_backend() != "gpu" or not jax_attn_dist.kernel_available():
        print("bench.py needs a CUDA GPU and the built kernel", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    gemm = gemm_ceiling(args.calls, args.samples)
    result = {
        "device": dev.device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "gemm_8192_tflops": gemm,
        "timing": f"median of {args.samples} samples x {args.calls} back-to-back calls, 2 input sets",
        "shapes": [],
    }
    print(f"{dev.device_kind}  jax {jax.__version__}  dense bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s", flush=True)
    for name in args.shapes:
        row = bench_shape(name, SHAPES[name], calls=args.calls, samples=args.samples, gemm_tflops=gemm,
                          with_xla=not args.no_xla)
        result["shapes"].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    hdr = f"{'shape':<16}{'kernel ms':>10}{'TFLOP/s':>9}{'of GEMM':>8}{'XLA ms':>9}{'speedup':>8}{'XLA tmp GB':>11}{'rel err':>9}"
    print("\n" + hdr)
    for r in result["shapes"]:
        xla_gb = (r.get("xla_extra_bytes") or 0) / 1e9
        print(f"{r['name']:<16}{r['kernel_ms']:>10.3f}{r['kernel_tflops']:>9.0f}{r['kernel_frac_gemm']:>8.0%}"
              f"{r.get('xla_ms', float('nan')):>9.2f}{r.get('speedup_vs_xla', float('nan')):>7.2f}x"
              f"{xla_gb:>11.2f}{r.get('rel_err_vs_xla', float('nan')):>9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
