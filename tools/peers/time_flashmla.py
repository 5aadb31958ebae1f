"""FlashMLA's SM90 sparse prefill forward beside sparse_mla, in one process.

The inputs are the benchmark's ``mla-v32-*`` problems (benchmarks/
sparse_mla_bench.py: unbatched q [S, H, D], kv [N, 1, D], indices [S, 1, T]
of T distinct causal-visible keys per row, sm_scale = D ** -0.5), which are
FlashMLA's layout as they stand. FlashMLA has no causal rule; its indices are
taken as given, and with these every slot is visible, so both compute the
same attention.

FlashMLA runs from the shared library that tools/peers/flashmla_sparse_prefill.sh
builds (ctypes, raw device pointers of the JAX input arrays, outputs in buffers
of its own). Per head count: one call of each, checked against each other
(out: relative Frobenius and max errors; lse: FlashMLA's is natural-log, ours
is converted from its ``lse_base``), against the problem's exact lse, and each
out on ``--check-rows`` random rows against a float64 evaluation; then
both timed, ``--rounds`` times alternately (the best of each kept):
  * sparse_mla as benchmarks/bench.py times it (timing.time_calls: median of
    ``--samples`` samples of ``--calls`` back-to-back calls over two input sets);
  * FlashMLA with CUDA events around ``--iters`` launches after ``--warmup``.
TFLOP/s count 2 * S * H * T * (D + d_v).

    tools/peers/flashmla_sparse_prefill.sh .peer/flashmla /tmp/flashmla_harness.so
    python3 tools/peers/time_flashmla.py --heads 128 64 --out /tmp/flashmla.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FlashMLA's outputs are cudaMalloc'ed

import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from jax_attn_dist import oracle  # noqa: E402
from bench import git_commit, kernel_build_id  # noqa: E402
from sparse_mla_bench import lse_error, sparse_mla_flops, sparse_mla_problem  # noqa: E402
from timing import time_calls  # noqa: E402

P, I, F, V = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
FWD_ARGS = [P, P, P, P, P, P, I, I, I, I, I, I, F, P]  # q kv indices out max_logits lse s_q s_kv h_q d_qk d_v topk scale stream


def load_harness(path):
    lib = ctypes.CDLL(path)
    lib.flashmla_sparse_fwd.argtypes = FWD_ARGS
    lib.flashmla_sparse_fwd_time.argtypes = FWD_ARGS + [I, I, ctypes.POINTER(F)]
    lib.flashmla_malloc.argtypes, lib.flashmla_malloc.restype = [V], P
    lib.flashmla_free.argtypes = [P]
    lib.flashmla_to_host.argtypes = [P, P, V]
    return lib


def ok(rc, what):
    if rc != 0:
        raise RuntimeError(f"flashmla_harness: {what} returned {rc} (see stderr)")


class FlashMLA:
    """One problem's FlashMLA call: input pointers and output buffers."""

    def __init__(self, lib, q, kv, indices, *, sm_scale, d_v):
        jax.block_until_ready((q, kv, indices))
        self.lib, self.keep = lib, (q, kv, indices)  # the arrays outlive every launch
        (S, H, D), (N, _, _), T = q.shape, kv.shape, indices.shape[-1]
        self.shape = (S, H, d_v)
        self.bytes = {"out": S * H * d_v * 2, "max_logits": S * H * 4, "lse": S * H * 4}
        self.buf = {k: lib.flashmla_malloc(n) for k, n in self.bytes.items()}
        if not all(self.buf.values()):
            raise MemoryError("flashmla_harness: cudaMalloc failed")
        ptr = [x.unsafe_buffer_pointer() for x in (q, kv, indices)]
        self.args = ptr + [self.buf["out"], self.buf["max_logits"], self.buf["lse"], S, N, H, D, d_v, T,
                           float(sm_scale), None]

    def run(self):
        """(out float32 [S, H, d_v], lse float32 [S, H], natural log)."""
        ok(self.lib.flashmla_synchronize(), "synchronize")
        ok(self.lib.flashmla_sparse_fwd(*self.args), "forward")
        out = np.empty(self.shape, np.uint16)
        lse = np.empty(self.shape[:2], np.float32)
        ok(self.lib.flashmla_to_host(out.ctypes.data, self.buf["out"], self.bytes["out"]), "copy")
        ok(self.lib.flashmla_to_host(lse.ctypes.data, self.buf["lse"], self.bytes["lse"]), "copy")
        return (out.astype(np.uint32) << 16).view(np.float32), lse

    def time(self, warmup, iters):
        """Mean seconds per launch."""
        ok(self.lib.flashmla_synchronize(), "synchronize")
        ms = F()
        ok(self.lib.flashmla_sparse_fwd_time(*self.args, warmup, iters, ctypes.byref(ms)), "timed forwards")
        return ms.value * 1e-3

    def free(self):
        for p in self.buf.values():
            self.lib.flashmla_free(p)


def rel_errors(out, ref):
    """(||out-ref|| / ||ref||, max|out-ref| / max|ref|), float64 accumulation."""
    d = out.astype(np.float64) - ref
    return (float(np.linalg.norm(d) / np.linalg.norm(ref.astype(np.float64))),
            float(np.abs(d).max() / np.abs(ref).max()))


def to_natural(lse, base):
    return np.asarray(lse, np.float32) * (math.log(2.0) if base == "2" else 1.0)


def row(lib, S, N, H, T, D, d_v, args):
    import jax_attn_dist

    sets = [sparse_mla_problem(S, N, H, T, D, d_v, seed) for seed in (0, 1)]
    kw, exact_lse = sets[0][1], sets[0][2]
    arg_sets = [a for a, _, _ in sets]
    flops = sparse_mla_flops(S, H, T, D, d_v)
    ours = jax.jit(lambda q, kv, i: jax_attn_dist.sparse_mla(q, kv, i, implementation="cuda", **kw))
    out_o, lse_o = jax.block_until_ready(ours(*arg_sets[0]))
    fm = FlashMLA(lib, *arg_sets[0], sm_scale=kw["sm_scale"], d_v=d_v)
    try:
        out_f, lse_f = fm.run()
        out_o = np.asarray(out_o, np.float32)
        rel, max_rel = rel_errors(out_f, out_o)
        rows = np.random.default_rng(0).choice(S, size=min(S, args.check_rows), replace=False)
        # The float64 oracle on those rows alone; every index the problem drew is causal-visible (its padding,
        # -1, is out of range), so the rows need no causal rule of their own.
        q, kv, indices = (np.asarray(x) for x in arg_sets[0])
        ref, _ = oracle.sparse_mla_oracle(q[rows], kv, indices[rows], sm_scale=kw["sm_scale"], d_v=d_v, causal=False)
        r = {"name": f"mla-S{S}-N{N}-H{H}-T{T}", "S": S, "N": N, "H": H, "T": T, "D": D, "d_v": d_v,
             "flops": flops, "sm_scale": kw["sm_scale"],
             "out_rel_err": rel, "out_max_err_rel_to_max": max_rel,
             "checked_rows": len(rows), "ours_out_rel_err_vs_float64": rel_errors(out_o[rows], ref)[0],
             "flashmla_out_rel_err_vs_float64": rel_errors(out_f[rows], ref)[0],
             "lse_err_vs_ours": lse_error(lse_f, to_natural(lse_o, kw["lse_base"])),
             "flashmla_lse_err_vs_exact": lse_error(lse_f, to_natural(exact_lse, kw["lse_base"])),
             "ours_lse_err_vs_exact": lse_error(to_natural(lse_o, kw["lse_base"]),
                                                to_natural(exact_lse, kw["lse_base"]))}
        del out_f, out_o
        t_o, t_f = [], []
        for _ in range(args.rounds):
            t_o.append(time_calls(ours, arg_sets, calls=args.calls, samples=args.samples))
            t_f.append(fm.time(args.warmup, args.iters))
    finally:
        fm.free()
    r.update(ours_ms_rounds=[t * 1e3 for t in t_o], flashmla_ms_rounds=[t * 1e3 for t in t_f])
    t_o, t_f = min(t_o), min(t_f)
    r.update(ours_ms=t_o * 1e3, ours_tflops=flops / t_o / 1e12, flashmla_ms=t_f * 1e3,
             flashmla_tflops=flops / t_f / 1e12, flashmla_time_over_ours=t_f / t_o)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--so", default="/tmp/flashmla_harness.so", help="the harness library")
    ap.add_argument("--flashmla-dir", default=os.path.join(ROOT, ".peer", "flashmla"),
                    help="the FlashMLA source it was built from (its COMMIT file, if any, is recorded)")
    ap.add_argument("--flashmla-commit", default=None, help="FlashMLA's commit, where no COMMIT file is at hand")
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--D", type=int, default=576)
    ap.add_argument("--d-v", type=int, default=512)
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--warmup", type=int, default=5, help="FlashMLA launches before the timed ones")
    ap.add_argument("--iters", type=int, default=20, help="FlashMLA launches between the events")
    ap.add_argument("--calls", type=int, default=10, help="sparse_mla launches per timed sample (as bench.py)")
    ap.add_argument("--samples", type=int, default=15, help="sparse_mla timed samples (as bench.py)")
    ap.add_argument("--rounds", type=int, default=2, help="alternate rounds of both timings; the best kept")
    ap.add_argument("--check-rows", type=int, default=32, help="rows whose out both are checked against float64")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)

    import jax_attn_dist

    if jax.default_backend() != "gpu" or not jax_attn_dist.kernel_available():
        print("time_flashmla.py needs a CUDA GPU and the built kernel", file=sys.stderr)
        return 2
    lib = load_harness(args.so)
    commit_file = os.path.join(args.flashmla_dir, "COMMIT")
    result = {"commit": git_commit(), "kernel_build_id": kernel_build_id(),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "flashmla_commit": (open(commit_file).read().strip() if os.path.exists(commit_file)
                                  else args.flashmla_commit),
              "timing": {"ours": f"bench.py's time_calls: median of {args.samples} x {args.calls} calls, 2 input "
                                 f"sets, best of {args.rounds} rounds",
                         "flashmla": f"cudaEvents over {args.iters} launches after {args.warmup}, one input set, "
                                     f"best of {args.rounds} rounds"},
              "rows": []}
    for H in args.heads:
        r = row(lib, args.S, args.N, H, args.T, args.D, args.d_v, args)
        result["rows"].append(r)
        print(json.dumps(r), flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
