#!/usr/bin/env bash
# A/B benchmark on one machine in one call: older trees (`git archive`
# tarballs carried in .whl/) against this checkout. Every tree is built once
# into its own directory, side by side (the cores shared between the builds);
# then ROUNDS rounds (default 2) run each side back to back, alternating, so
# that neither the machine-to-machine spread (about 5 %) nor a drift during the
# call favours one side.
#   git archive OLD -o .whl/old.tar                      # in the checkout
#   ROUNDS=3 tools/ab_bench.sh .whl/old.tar OLD NEW idx-v32 ...   # on the GPU machine, OUT set
# More sides (each another tree, timed between old and new in every round):
#   MORE=".whl/b.tar:B .whl/c.tar:C" tools/ab_bench.sh .whl/old.tar OLD NEW topk-v32
# Every side runs this checkout's benchmarks/bench.py (one harness, so only the
# package differs); a shape an older package cannot serve fails its side.
# Writes $OUT/ab.json (every round's rows, every side); the comparison is printed.
# Checks of this checkout in the same call, run after the rounds and their
# comparison, so that a call its time limit cuts short still has the timings
# (this checkout is then built first, by tools/gpu_check.sh's build step
# with its test-only FFI targets and build-id check, alone: that step reinstalls
# the CUTLASS wheel the other builds read; and timed from that install):
#   TESTS="tests/sparse_mla/test_gpu.py -k negative"  one pytest run (--run-large,
#                                                     JAX_ATTN_DIST_REQUIRE_GPU=1): $OUT/tests.log
#   CHECKS="sanitize-bwd sanitize-new"                tools/gpu_check.sh steps: $OUT/checks/
# A failed check is printed and makes the exit status 2.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
tar=$1 old=$2 new=$3; shift 3
shapes=("$@")
# side label -> tarball ("" for this checkout), in the order each round runs them
labels=("$old") tars=("$tar")
for entry in ${MORE:-}; do
  labels+=("${entry##*:}") tars+=("${entry%:*}")
done
labels+=("$new") tars+=("")
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / ${#labels[@]} > 1 ? $(nproc) / ${#labels[@]} : 1 ))
rm -rf /tmp/ab && mkdir -p /tmp/ab
checks=${TESTS:-}${CHECKS:-}
last=$(( ${#labels[@]} - 1 ))
if [ -n "$checks" ]; then  # this checkout, installed for the checks (CUTLASS with it)
  OUT=$OUT/checks CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) bash tools/gpu_check.sh build > /tmp/ab/checks.build.log 2>&1 ||
    { echo "this checkout: build failed"; tail -30 /tmp/ab/checks.build.log; exit 1; }
else
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/nvidia_cutlass*.whl
fi
pids=()
for i in "${!labels[@]}"; do
  [ "$i" = "$last" ] && [ -n "$checks" ] && continue  # built above
  src=$PWD
  if [ -n "${tars[$i]}" ]; then
    src=/tmp/ab/src$i && mkdir -p "$src" && tar -xf "${tars[$i]}" -C "$src"
  fi
  (cd "$src" && PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/ab/side$i" . \
     > "/tmp/ab/side$i.build.log" 2>&1) &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "side ${labels[$i]}: build failed"; tail -30 "/tmp/ab/side$i.build.log"; exit 1; }
done
side_path() {  # the side's package ahead of the CUTLASS wheel (this checkout's installed one, where checks ran)
  if [ "$1" = "$last" ] && [ -n "$checks" ]; then echo /tmp/site; else echo "/tmp/ab/side$1:/tmp/site"; fi
}
status=0
bench_dir=$PWD/benchmarks
for ((r = 1; r <= ROUNDS; r++)); do
  for i in "${!labels[@]}"; do
    # Run from /tmp so that no checkout's package shadows the built one.
    (cd /tmp && PYTHONPATH="$(side_path "$i")" JAX_ATTN_DIST_COMMIT=${labels[$i]} timeout 400 \
       python3 "$bench_dir/bench.py" --no-xla --shapes "${shapes[@]}" --json "/tmp/ab/side$i-$r.json" \
       > "/tmp/ab/side$i-$r.log" 2>&1) || { tail -30 "/tmp/ab/side$i-$r.log"; exit 1; }
  done
done
python3 - "$OUT/ab.json" "$ROUNDS" "${labels[@]}" <<'PY'
import json, sys
out, rounds, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
runs = {f"{label}/{r}": json.load(open(f"/tmp/ab/side{i}-{r}.json"))
        for r in range(1, rounds + 1) for i, label in enumerate(labels)}
json.dump(runs, open(out, "w"), indent=1)
keys = ("kernel_ms", "kernel_bwd_ms", "bwd_deterministic_ms", "kernel_fwd_bwd_ms")
first = labels[0]
for r in range(1, rounds + 1):
    side = {label: runs[f"{label}/{r}"] for label in labels}
    print(f"round {r} (GEMM " + " / ".join(f"{s['gemm_8192_tflops']:.0f}" for s in side.values()) + " TFLOP/s)")
    for n, base in enumerate(side[first]["rows"]):
        for key in keys:
            if key not in base:
                continue
            cells = [f"{base[key]:9.3f}"]
            for label in labels[1:]:
                row = side[label]["rows"][n]
                if key in row:
                    cells.append(f"{label} {row[key]:9.3f} ({row[key] / base[key] - 1:+.1%})")
            print(f"  {base['name']:<18}{key:<22}{first} " + "  ".join(cells))
PY
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086  # TESTS is a pytest argument list
  JAX_ATTN_DIST_REQUIRE_GPU=1 PYTHONPATH=/tmp/site timeout "${TEST_LIMIT:-400}" python3 -m pytest -q -rfEs $TESTS \
    --run-large -p no:cacheprovider > "$OUT/tests.log" 2>&1 || status=2
  echo "tests: $(tail -n 1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log"
fi
if [ -n "${CHECKS:-}" ]; then
  # shellcheck disable=SC2086  # CHECKS is a list of gpu_check.sh steps
  OUT=$OUT/checks bash tools/gpu_check.sh $CHECKS | sed -n '/^== summary/,$p' || status=2
fi
exit $status
