#!/usr/bin/env bash
# A/B benchmark on one machine in one call: an older tree (a `git archive`
# tarball carried in .whl/) against this checkout. Each is built once into its
# own directory; then ROUNDS rounds (default 2) run old and new back to back,
# alternating, so that neither the machine-to-machine spread (about 5 %) nor a
# drift during the call favours one side.
#   git archive OLD -o .whl/old.tar                      # in the checkout
#   ROUNDS=3 tools/ab_bench.sh .whl/old.tar OLD NEW idx-v32 ...   # on the GPU machine, OUT set
# Both sides run this checkout's benchmarks/bench.py (one harness, so only the
# package differs); a shape the old package cannot serve fails its side.
# Writes $OUT/ab.json (every round's rows, both sides); the comparison is printed.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
tar=$1 old=$2 new=$3; shift 3
shapes=("$@")
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=16
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/nvidia_cutlass*.whl
rm -rf /tmp/ab && mkdir -p /tmp/ab/old_src && tar -xf "$tar" -C /tmp/ab/old_src
build() {  # source dir, side
  (cd "$1" && PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/ab/$2" . \
     > "/tmp/ab/$2.build.log" 2>&1) || { tail -30 "/tmp/ab/$2.build.log"; exit 1; }
}
build /tmp/ab/old_src old
build "$PWD" new
bench_dir=$PWD/benchmarks
for ((r = 1; r <= ROUNDS; r++)); do
  for side in old new; do
    # Run from /tmp so that neither checkout's package shadows the built one.
    commit=$([ $side = old ] && echo "$old" || echo "$new")
    (cd /tmp && PYTHONPATH="/tmp/ab/$side:/tmp/site" JAX_ATTN_DIST_COMMIT=$commit timeout 400 \
       python3 "$bench_dir/bench.py" --no-xla --shapes "${shapes[@]}" --json "/tmp/ab/$side$r.json" \
       > "/tmp/ab/$side$r.log" 2>&1) || { tail -30 "/tmp/ab/$side$r.log"; exit 1; }
  done
done
python3 - "$OUT/ab.json" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = {f"{side}{r}": json.load(open(f"/tmp/ab/{side}{r}.json")) for r in range(1, rounds + 1) for side in ("old", "new")}
json.dump(runs, open(out, "w"), indent=1)
keys = ("kernel_ms", "kernel_bwd_ms", "bwd_deterministic_ms", "kernel_fwd_bwd_ms")
for r in range(1, rounds + 1):
    print(f"round {r} (GEMM {runs[f'old{r}']['gemm_8192_tflops']:.0f} / {runs[f'new{r}']['gemm_8192_tflops']:.0f} TFLOP/s)")
    for a, b in zip(runs[f"old{r}"]["rows"], runs[f"new{r}"]["rows"]):
        for key in keys:
            if key in a and key in b:
                print(f"  {a['name']:<14}{key:<22}{a[key]:9.3f} -> {b[key]:9.3f} ms  ({b[key] / a[key] - 1:+.1%})")
PY
