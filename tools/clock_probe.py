"""SM clock and board power while each kernel runs back to back (docs/PERFORMANCE.md §27).

The benchmark does not lock clocks. This runs the same-process GEMM ceiling and
each attn_dist shape for a few seconds each, with nvidia-smi sampling the SM
clock, power draw and the clock-event reasons every 20 ms, and prints per
phase the achieved rate, the median clock and power, and the share of samples
with the software power cap active. On the device:
  python3 tools/clock_probe.py [--json OUT] [--seconds 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402

import jax_attn_dist  # noqa: E402
from jax_attn_dist import synthetic  # noqa: E402

FIELDS = ("timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.sw_power_cap,"
          "clocks_event_reasons.hw_slowdown,clocks_event_reasons.sw_thermal_slowdown")


def parse_sample(line):
    """One nvidia-smi CSV line (FIELDS, noheader, nounits) as (epoch seconds,
    SM MHz, watts, deg C, power cap, hw slowdown, thermal), or None."""
    parts = [p.strip() for p in line.split(",")]
    try:
        stamp, frac = parts[0].split(".")
        ts = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
        return (ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4] == "Active", parts[5] == "Active",
                parts[6] == "Active")
    except (ValueError, IndexError):
        return None


def run_for(fn, arg_sets, seconds):
    """Calls fn back to back for about `seconds`; returns (t0, t1, calls)."""
    jax.block_until_ready(fn(*arg_sets[0]))
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        out = None
        for i in range(10):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        n += 10
    return t0, time.time(), n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--shapes", nargs="*", default=["v32-h128", "v32-h64", "small", "v32-h128-128k"])
    args = ap.parse_args()
    log = "/tmp/clock_probe_smi.csv"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=open(log, "w"), stderr=subprocess.DEVNULL)
    phases = []
    try:
        time.sleep(1.0)
        phases.append(("idle", time.time() - 1.0, time.time(), 0, 0.0))
        mm, sets, flops = bench.gemm_problem()
        t0, t1, calls = run_for(mm, sets, args.seconds)
        phases.append(("gemm-8192", t0, t1, calls, flops))
        for name in args.shapes:
            S, N, H, T, D = bench.ATTN_SHAPES[name]
            probs = [synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=s) for s in (0, 1)]
            kw = probs[0].kwargs
            fn = jax.jit(lambda q, k, i, l, kw=kw: jax_attn_dist.attn_dist(q, k, i, l, implementation="cuda", **kw))
            t0, t1, calls = run_for(fn, [p.arrays for p in probs], args.seconds)
            phases.append((name, t0, t1, calls, probs[0].flops))
            del probs
        time.sleep(0.2)
    finally:
        smi.terminate()
        smi.wait()
    samples = [s for s in map(parse_sample, open(log)) if s is not None]
    rows = []
    for name, t0, t1, calls, flops in phases:
        # Skip the first 0.5 s of a phase: the clock settles.
        inside = [s for s in samples if t0 + 0.5 <= s[0] <= t1]
        row = {"phase": name, "seconds": t1 - t0, "calls": calls, "samples": len(inside)}
        if calls:
            row["ms_per_call"] = (t1 - t0) / calls * 1e3
            row["tflops"] = flops * calls / (t1 - t0) / 1e12
        if inside:
            row.update(sm_mhz_median=statistics.median(s[1] for s in inside), sm_mhz_min=min(s[1] for s in inside),
                       power_w_median=statistics.median(s[2] for s in inside), temp_c_max=max(s[3] for s in inside),
                       power_cap_share=sum(s[4] for s in inside) / len(inside),
                       hw_slowdown_share=sum(s[5] for s in inside) / len(inside),
                       thermal_share=sum(s[6] for s in inside) / len(inside))
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        json.dump({"device": jax.devices()[0].device_kind, "phases": rows}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
