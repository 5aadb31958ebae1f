#!/usr/bin/env bash
# A/B benchmark on one machine in one call: an older tree (a `git archive`
# tarball carried in .whl/) against this checkout, built and timed back to
# back, so that the machine-to-machine spread (about 5 %) does not enter.
#   git archive OLD -o .whl/old.tar                      # here
#   tools/ab_bench.sh .whl/old.tar OLD NEW idx-v32 ...   # on the device, OUT set
# Writes $OUT/old.json and $OUT/new.json; the comparison is printed.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
tar=$1 old=$2 new=$3; shift 3
shapes=("$@")
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/nvidia_cutlass*.whl
rm -rf /tmp/ab_old && mkdir -p /tmp/ab_old && tar -xf "$tar" -C /tmp/ab_old
bench() {  # dir, commit, json
  (cd "$1" && python3 -m pip install -q --no-build-isolation --no-deps . > "$3.build.log" 2>&1 &&
   JAX_ATTN_DIST_COMMIT=$2 timeout 300 python3 benchmarks/bench.py --no-xla --shapes "${shapes[@]}" --json "$3")
}
bench /tmp/ab_old "$old" "$OUT/old.json" || exit 1
bench "$PWD" "$new" "$OUT/new.json" || exit 1
python3 - "$OUT/old.json" "$OUT/new.json" <<'PY'
import json, sys
old, new = (json.load(open(p))["rows"] for p in sys.argv[1:])
for a, b in zip(old, new):
    for key in ("kernel_ms", "kernel_bwd_ms", "bwd_deterministic_ms", "kernel_fwd_bwd_ms"):
        if key in a and key in b:
            print(f"{a['name']:<14}{key:<20}{a[key]:9.3f} -> {b[key]:9.3f} ms  ({b[key] / a[key] - 1:+.1%})")
PY
