"""``python -m jax_attn_dist``: run attn_dist on a synthetic DSA-shaped problem.

Builds a seeded random problem (causal top-k indices, exact lse), runs
``attn_dist`` under jit, times it, compares it with the jnp reference and
checks the row-sum invariant. Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from . import __version__, _contract, _ext, synthetic
from .primitive import attn_dist
from .reference import attn_dist_reference

GPU_DEFAULTS = dict(seq=1024, keys=4096, heads=128, topk=512, dim=576, repeats=20)
CPU_DEFAULTS = dict(seq=128, keys=1024, heads=128, topk=128, dim=576, repeats=3)
INVARIANT_TOLERANCE = 1e-3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_attn_dist",
        description=(
            "Run attn_dist on a synthetic DeepSeek-Sparse-Attention-shaped problem "
            "(random bf16 q/k, causal top-k indices, exact lse), time it, compare it "
            "with the jnp reference and check that each group row sums to its number "
            "of heads. Defaults: S=%(seq)d N=%(keys)d H=%(heads)d T=%(topk)d D=%(dim)d "
            "on a GPU; " % GPU_DEFAULTS
            + "S=%(seq)d N=%(keys)d H=%(heads)d T=%(topk)d D=%(dim)d on CPU." % CPU_DEFAULTS
        ),
    )
    p.add_argument("-S", "--seq", type=int, help="query rows S")
    p.add_argument("-N", "--keys", type=int, help="compressed keys N")
    p.add_argument("--heads", type=int, help="query heads H (groups of 64)")
    p.add_argument("--topk", type=int, help="top-k slots T per query")
    p.add_argument("--dim", type=int, help="head dim D (the CUDA kernel takes 512 or 576)")
    p.add_argument("--batch", type=int, default=None, help="batch B (default: unbatched)")
    p.add_argument("--k-stride", type=int, default=1, help="key compression stride (default 1)")
    p.add_argument("--lse-base", choices=["2", "e"], default="2", help="base of lse (default 2)")
    p.add_argument(
        "--implementation", choices=["auto", "cuda", "xla"], default="auto",
        help="auto: the CUDA kernel where it applies, else XLA (default)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--repeats", type=int, help="timed runs after warm-up (median reported)")
    return p


def _path_used(fn, args) -> str:
    text = jax.jit(fn).lower(*args).as_text()
    return "cuda kernel" if _contract.FFI_TARGET in text else "jnp reference (XLA)"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    implementation = None if args.implementation == "auto" else args.implementation

    problem = synthetic.make_problem(
        S=args.seq, N=args.keys, H=args.heads, T=args.topk, D=args.dim, B=args.batch,
        k_stride=args.k_stride, lse_base=args.lse_base, seed=args.seed,
    )
    arrays = problem.arrays
    kw = problem.kwargs
    q_start = kw.pop("q_start_index")

    def run(q, k, indices, lse, q_start_index):
        return attn_dist(q, k, indices, lse, q_start_index=q_start_index, implementation=implementation, **kw)

    def ref(q, k, indices, lse, q_start_index):
        return attn_dist_reference(q, k, indices, lse, q_start_index=q_start_index, **kw)

    call_args = (*arrays, q_start)
    try:
        path = _path_used(run, call_args)
    except (ValueError, RuntimeError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_jit = jax.jit(run)
    out = run_jit(*call_args).block_until_ready()
    for _ in range(2):
        run_jit(*call_args).block_until_ready()
    times = []
    for _ in range(max(args.repeats, 1)):
        t0 = time.perf_counter()
        run_jit(*call_args).block_until_ready()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)

    expected = jax.jit(ref)(*call_args).block_until_ready()
    rel, max_abs, max_ref = synthetic.compare(out, expected)
    inv = synthetic.invariant_error(out, problem.lse)
    ok_ref = synthetic.within_spec(out, expected)
    ok_inv = inv <= INVARIANT_TOLERANCE
    ok_finite = bool(jnp.isfinite(out).all())

    B = args.batch
    shape = (f"B={B} " if B is not None else "") + (
        f"S={args.seq} N={args.keys} H={args.heads} T={args.topk} D={args.dim} "
        f"k_stride={args.k_stride} lse_base={args.lse_base}"
    )
    device = jax.devices()[0]
    print(f"jax_attn_dist {__version__}, jax {jax.__version__}")
    print(f"device:      {device.platform} {getattr(device, 'device_kind', '')}")
    print(f"kernel:      {'available' if _ext.kernel_available() else 'unavailable'} "
          f"({_ext.kernel_unavailable_reason()})")
    print(f"path:        {path}")
    print(f"shape:       {shape}")
    print(f"time:        {median * 1e3:.3f} ms (median of {len(times)}), "
          f"{problem.flops / median / 1e12:.2f} TFLOP/s")
    print(f"vs reference: max abs err {max_abs:.3e} (max |ref| {max_ref:.3e}), "
          f"rel Frobenius err {rel:.3e}  [{'ok' if ok_ref else 'FAIL'}, tol {synthetic.SPEC_TOLERANCE:g}]")
    print(f"invariant:   max rel row-sum err {inv:.3e}  "
          f"[{'ok' if ok_inv else 'FAIL'}, tol {INVARIANT_TOLERANCE:g}]")
    if not ok_finite:
        print("output:      non-finite values  [FAIL]")
    ok = ok_ref and ok_inv and ok_finite
    print("result:      " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
