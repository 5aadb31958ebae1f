"""Benchmark: the CUDA kernels vs the same work written in XLA vs a dense GEMM.

Everything is timed in one process on one GPU, side by side (docs/SPEC.md §4
and §7):

* ``attn_dist`` shapes (§4): the kernel, the jnp reference under XLA, and a
  dense bf16 8192^3 matmul, the practical ceiling. FLOPs = 2*B*S*H*T*D.
* indexer shapes (§7): ``indexer_kl``'s forward on the kernel, its jnp path,
  and the loss written plainly in XLA (gather + einsum + log_softmax + KL,
  materialised); forward and forward + backward. FLOPs = 2*B*S*HI*T*DI.
* ``step-v32`` (§7): the indexer training step, ``jax.value_and_grad`` of the
  mean ``indexer_loss`` (the attn_dist target of v32-h128, normalised, plus
  the idx-v32 indexer loss, forward and backward) against the same step with
  the indexer loss written in XLA around the attn_dist kernel.
* SPEC §6 rows (``PACKING``): a packed call (4 sequences of 1024 rows) or a
  ``topk_length = T / 2`` call against the same kernel call without §6
  (``ratio`` = §6 time / plain time); for the indexer also its backward.
* ``sparse_mla`` shapes (§8, ``mla-*``, ``mla-bwd-*``): the forward and
  backward kernels against sparse MLA written plainly in XLA (bf16 products,
  P rounded to bf16; its backward XLA's autodiff) and against the package's
  jnp path (``jnp``: the float32 reference): the forward at the v32 shapes,
  the backward at H = 128. FLOPs = 2*B*S*H*T*(D + d_v) forward, 2*B*S*H*T*(3D
  + 2 d_v) backward.
* ``dsa-layer-v32`` (§10): the whole layer, ``dsa_attention``'s forward plus
  backward of ``sum(out * g) + mean(kl)`` on the kernels, against the same
  layer written plainly in XLA and with ``implementation="xla"`` (``jnp``),
  with each one's temporaries and its time op by op (top-k, sparse MLA
  forward, its backward, the indexer loss forward + backward, each timed
  alone).
* ``indexer_topk`` shapes (§9, ``topk-*``): the kernel and its jnp path
  under XLA (topk-v32 only); FLOPs = the causal logits GEMM (2*HI*DI per
  visible (row, key), about 2*S*(N - S/2)*HI*DI), and ``floor ms`` those
  FLOPs at the GEMM ceiling's rate.

Timing: each sample enqueues ``--calls`` back-to-back launches of one jitted
call (alternating between two input sets, so repeated runs do not just
re-read one buffer from L2) and blocks once; the per-call time of a sample is
its wall time / calls, and the reported figure is the median over
``--samples`` samples after warm-up. Host dispatch overlaps device work, so
this is device time per call to within the launch gap.

Memory: XLA's own accounting of each compiled call (temporaries + output),
the device memory each path needs beyond its inputs.

    python benchmarks/bench.py                            # everything
    python benchmarks/bench.py --shapes v32-h128 idx-v32 --json results.json

With ``--json X.json`` the results go to X.json and a plot (TFLOP/s per
shape: kernel, XLA, GEMM ceiling) to X.png; ``--plot X.json`` redraws the
plot from a results file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the per-op modules beside this file

from attn_dist_bench import ATTN_SHAPES, bench_attn_dist  # noqa: E402
from dsa_bench import DSA_SHAPES, bench_dsa_layer  # noqa: E402
from indexer_bench import INDEXER_SHAPES, STEPS, bench_indexer, bench_step  # noqa: E402
from indexer_topk_bench import TOPK_SHAPES, bench_indexer_topk, logits_flops  # noqa: E402,F401
from packing_bench import PACKING, bench_packing, packed_layout  # noqa: E402,F401
from plain_xla import xla_indexer_kl  # noqa: E402,F401
from sparse_mla_bench import (SPARSE_MLA_BWD_SHAPES, SPARSE_MLA_SHAPES, bench_sparse_mla,  # noqa: E402,F401
                              bench_sparse_mla_bwd, sparse_mla_bwd_flops, sparse_mla_flops)
from timing import gemm_ceiling, gemm_problem, log  # noqa: E402,F401  (gemm_problem: for callers)

#: Every row, by name: one line per op family.
ALL = (list(ATTN_SHAPES) + list(INDEXER_SHAPES) + list(STEPS) + list(PACKING) + list(SPARSE_MLA_SHAPES)
       + list(SPARSE_MLA_BWD_SHAPES) + list(TOPK_SHAPES) + list(DSA_SHAPES))


def git_commit(root: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) -> str:
    """The commit of the checkout that holds this file (``root``), with
    ``+modified`` where its tracked files differ from that commit: a copy of
    the tree whose ``.git`` is not its own (as on the device machine) then
    names no commit it does not hold. ``JAX_ATTN_DIST_COMMIT`` overrides."""
    if os.environ.get("JAX_ATTN_DIST_COMMIT"):
        return os.environ["JAX_ATTN_DIST_COMMIT"]
    try:
        def git(*args):
            return subprocess.check_output(["git", "-C", root, *args], text=True, stderr=subprocess.DEVNULL)
        commit = git("rev-parse", "--short", "HEAD").strip()
        return commit + "+modified" if git("status", "--porcelain", "--untracked-files=no").strip() else commit
    except Exception:  # noqa: BLE001
        return "unknown"


def kernel_build_id() -> str:
    """The loaded extension's build identity, a hash of the kernel sources
    (``jax_attn_dist._core.ext.build_id_of``): it names the kernels that ran
    even where the copy of the tree on the GPU machine has no (or stale) git
    metadata."""
    from jax_attn_dist._core import ext

    module = ext.extension_module()
    return module.build_id() if module is not None else "unknown"


def table(result) -> str:
    """The results as text; a column that does not apply to a row is blank."""
    columns = [  # header, width, value of a row (None: not measured for this row), format
        ("kernel ms", 10, lambda r: r.get("kernel_ms"), "{:.3f}"),
        ("TFLOP/s", 9, lambda r: r.get("kernel_tflops"), "{:.0f}"),
        ("of GEMM", 8, lambda r: r.get("kernel_frac_gemm"), "{:.0%}"),
        ("floor ms", 9, lambda r: r.get("gemm_floor_ms"), "{:.3f}"),
        ("XLA ms", 9, lambda r: r.get("xla_ms"), "{:.2f}"),
        ("speedup", 8, lambda r: r.get("speedup_vs_xla"), "{:.2f}x"),
        ("jnp ms", 9, lambda r: r.get("jnp_ms"), "{:.2f}"),
        ("XLA tmp GB", 11, lambda r: None if r.get("xla_extra_bytes") is None else r["xla_extra_bytes"] / 1e9,
         "{:.2f}"),
        ("fwd+bwd ms", 11, lambda r: r.get("kernel_fwd_bwd_ms"), "{:.3f}"),
        ("XLA f+b ms", 11, lambda r: r.get("xla_fwd_bwd_ms"), "{:.2f}"),
        ("bwd ms", 9, lambda r: r.get("kernel_bwd_ms"), "{:.3f}"),
        ("det bwd", 9, lambda r: r.get("bwd_deterministic_ms"), "{:.2f}"),
        ("§6 ratio", 9, lambda r: r.get("ratio"), "{:.3f}"),
    ]
    lines = [f"{'shape':<20}" + "".join(f"{h:>{w}}" for h, w, _, _ in columns)]
    for r in result["rows"]:
        cells = []
        for _, width, value, fmt in columns:
            v = value(r)
            cells.append(f"{'' if v is None else fmt.format(v):>{width}}")
        lines.append(f"{r['name']:<20}" + "".join(cells))
    return "\n".join(lines)


def plot(result, path: str) -> str | None:
    """TFLOP/s per shape: kernel, XLA, and the same-run GEMM ceiling."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plot: matplotlib is not installed; skipped (python benchmarks/bench.py --plot X.json redraws it)")
        return None
    rows = [r for r in result["rows"] if r.get("kernel_tflops") is not None]
    groups = [("attn_dist (FLOPs = 2 S H T D)", [r for r in rows if r["kind"] == "attn_dist"]),
              ("indexer_kl forward (FLOPs = 2 S HI T DI)", [r for r in rows if r["kind"] == "indexer"]),
              ("sparse_mla (FLOPs = 2 S H T (D + d_v))", [r for r in rows if r["kind"] == "sparse_mla"]),
              ("indexer_topk (FLOPs = causal logits GEMM)", [r for r in rows if r["kind"] == "indexer_topk"])]
    groups = [(title, rs) for title, rs in groups if rs]
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.8), squeeze=False)
    for ax, (title, rs) in zip(axes[0], groups):
        x = np.arange(len(rs))
        ax.bar(x - 0.2, [r["kernel_tflops"] for r in rs], 0.4, label="CUDA kernel")
        ax.bar(x + 0.2, [r.get("xla_tflops", 0.0) for r in rs], 0.4, label="XLA")
        ax.axhline(result["gemm_8192_tflops"], color="k", ls="--", lw=1,
                   label=f"dense bf16 GEMM ({result['gemm_8192_tflops']:.0f})")
        for xi, r in zip(x, rs):
            ax.text(xi - 0.2, r["kernel_tflops"], f"{r['kernel_ms']:.2f} ms", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [r["name"] for r in rs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"jax_attn_dist {result['commit']} on {result['device']}, jax {result['jax']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=ALL, choices=ALL)
    ap.add_argument("--calls", type=int, default=10, help="launches per timed sample")
    ap.add_argument("--samples", type=int, default=15, help="timed samples (median reported)")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA baselines")
    ap.add_argument("--json", default=None, help="write the results here (and a plot next to it)")
    ap.add_argument("--plot", default=None, metavar="JSON", help="only redraw the plot of a results file")
    args = ap.parse_args(argv)

    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        result.setdefault("rows", result.get("shapes", []))
        for r in result["rows"]:
            r.setdefault("kind", "attn_dist")
        log(f"plot: {plot(result, os.path.splitext(args.plot)[0] + '.png')}")
        return 0

    import jax_attn_dist

    if jax.default_backend() != "gpu" or not jax_attn_dist.kernel_available():
        print("bench.py needs a CUDA GPU and the built kernel", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    t0 = time.perf_counter()
    gemm = gemm_ceiling(args.calls, args.samples)
    result = {
        "device": dev.device_kind, "jax": jax.__version__, "python": platform.python_version(),
        "commit": git_commit(), "kernel_build_id": kernel_build_id(), "gemm_8192_tflops": gemm,
        "timing": f"median of {args.samples} samples x {args.calls} back-to-back calls, 2 input sets",
        "rows": [],
    }
    log(f"{dev.device_kind}  jax {jax.__version__}  dense bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s")
    opts = dict(calls=args.calls, samples=args.samples, gemm_tflops=gemm, with_xla=not args.no_xla)
    for i, name in enumerate(args.shapes, 1):
        log(f"[{i}/{len(args.shapes)}] {name} ... ({time.perf_counter() - t0:.0f} s elapsed)")
        t_shape = time.perf_counter()
        if name in ATTN_SHAPES:
            row = bench_attn_dist(name, ATTN_SHAPES[name], **opts)
        elif name in INDEXER_SHAPES:
            row = bench_indexer(name, INDEXER_SHAPES[name], **opts)
        elif name in PACKING:
            row = bench_packing(name, **opts)
        elif name in SPARSE_MLA_SHAPES:
            row = bench_sparse_mla(name, SPARSE_MLA_SHAPES[name], **opts)
        elif name in SPARSE_MLA_BWD_SHAPES:
            row = bench_sparse_mla_bwd(name, SPARSE_MLA_BWD_SHAPES[name], **opts)
        elif name in DSA_SHAPES:
            row = bench_dsa_layer(name, DSA_SHAPES[name], **opts)
        elif name in TOPK_SHAPES:
            row = bench_indexer_topk(name, TOPK_SHAPES[name], **opts)
        else:
            row = bench_step(name, **opts)
        row["bench_seconds"] = time.perf_counter() - t_shape
        result["rows"].append(row)
        log(json.dumps(row))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    log("\n" + table(result))
    if args.json:
        log(f"plot: {plot(result, os.path.splitext(args.json)[0] + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

