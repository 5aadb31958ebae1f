#!/usr/bin/env bash
# Diagnostic, not a product build (docs/PERFORMANCE.md §14): the idx-v32
# float32-mode backward's time when only a share of the d index_k row
# reductions is sent. This measures what merging dK rows could save at most.
# Each variant patches one line of a copy of this tree, so its gradients are
# wrong: the builds are for timing only. On the device, in the repo root:
#   bash tools/reduction_share.sh
# Prints the backward and deterministic-backward times (the latter unchanged,
# a control), two rounds.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=6
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/nvidia_cutlass*.whl
src=$PWD
line='if (row_key >= 0) reduce_row_async(d_keys'
grep -q "$line" csrc/indexer/bwd_kernel.cuh || { echo "the reduction line moved: update this script"; exit 1; }
build() {  # name, condition on (block, r) under which a row is reduced
  rm -rf "/tmp/v_$1" && mkdir -p "/tmp/v_$1" && cp -r "$src"/. "/tmp/v_$1/" && rm -rf "/tmp/v_$1/build"
  [ "$2" = all ] || sed -i "s|$line|if (row_key >= 0 \&\& ($2)) reduce_row_async(d_keys|" "/tmp/v_$1/csrc/indexer/bwd_kernel.cuh"
  (cd "/tmp/v_$1" && PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps \
     --target "/tmp/ab_$1" . > "/tmp/b_$1.log" 2>&1) || tail -20 "/tmp/b_$1.log"
}
build all all &
build five_sixths "(block * 64 + r) % 6 != 0" &
build three_fifths "(block * 64 + r) % 5 >= 2" &
build none "false" &
wait
for round in 1 2; do
  for v in all five_sixths three_fifths none; do
    (cd /tmp && PYTHONPATH="/tmp/ab_$v:/tmp/site" JAX_ATTN_DIST_COMMIT="$v" timeout 200 python3 \
       "$src/benchmarks/bench.py" --no-xla --shapes idx-v32 --json "/tmp/$v$round.json" > "/tmp/$v$round.log" 2>&1) \
      || tail -5 "/tmp/$v$round.log"
    python3 -c "import json; r = json.load(open('/tmp/$v$round.json'))['rows'][0]
print('$v', $round, round(r['kernel_bwd_ms'], 3), round(r['bwd_deterministic_ms'], 3))"
  done
done
