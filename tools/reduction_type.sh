#!/usr/bin/env bash
# Diagnostic, not a product build (docs/PERFORMANCE.md §16): what the
# backward's bulk reductions cost by element type and by bytes, and what the
# deterministic mode's float-to-int64 conversion costs. Each variant patches
# a copy of this tree, so its gradients are wrong: timing only.
#   shipped    this tree
#   u32, f32   the deterministic mode's bytes sent as .add.u32 / .add.f32
#              instead of .add.u64
#   half_rows  the float32 mode sending the first half of each dK row
#   f32_twice  the float32 mode sending each row twice (into its own row and
#              its neighbour's, N even): the deterministic mode's bytes
#   no_cvt     the deterministic mode with a bit cast in place of the
#              float-to-int64 conversion
# On the device, in the repo root:
#   bash tools/reduction_type.sh [variant ...]     (default: all)
# Prints the idx-v32 backward and deterministic-backward times, two rounds.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=4
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/nvidia_cutlass*.whl
src=$PWD
kernel=csrc/indexer/bwd_kernel.cuh fixed=csrc/indexer/fixed_point.cuh
u64='bulk_group.add.u64'
row='reduce_row_async(d_keys + int64_t(row_key) \* DI, plan.dk\[r\], DI \* int(sizeof(float)));'
cvt='return __float2ll_rn(x \* two_to_f);'
grep -q "$u64" $kernel && grep -q "$row" $kernel && grep -q "$cvt" $fixed || { echo "the patched lines moved: update this script"; exit 1; }
declare -A file=([shipped]=$kernel [u32]=$kernel [f32]=$kernel [half_rows]=$kernel [f32_twice]=$kernel [no_cvt]=$fixed)
declare -A patch=(
  [shipped]=""
  [u32]="s|$u64|bulk_group.add.u32|"
  [f32]="s|$u64|bulk_group.add.f32|"
  [half_rows]="s|$row|reduce_row_async(d_keys + int64_t(row_key) * DI, plan.dk[r], DI / 2 * int(sizeof(float)));|"
  [f32_twice]="s|$row|{ reduce_row_async(d_keys + int64_t(row_key) * DI, plan.dk[r], DI * int(sizeof(float))); reduce_row_async(d_keys + int64_t(row_key ^ 1) * DI, plan.dk[r], DI * int(sizeof(float))); }|"
  [no_cvt]="s|$cvt|return (long long)__float_as_int(x) + (long long)__float_as_int(two_to_f);|"
)
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(shipped u32 f32 half_rows f32_twice no_cvt)
build() {
  rm -rf "/tmp/v_$1" && mkdir -p "/tmp/v_$1" && cp -r "$src"/. "/tmp/v_$1/" && rm -rf "/tmp/v_$1/build"
  [ -z "${patch[$1]}" ] || sed -i "${patch[$1]}" "/tmp/v_$1/${file[$1]}"
  (cd "/tmp/v_$1" && PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps \
     --target "/tmp/ab_$1" . > "/tmp/b_$1.log" 2>&1) || tail -20 "/tmp/b_$1.log"
}
for v in "${variants[@]}"; do build "$v" & done
wait
for round in 1 2; do
  for v in "${variants[@]}"; do
    (cd /tmp && PYTHONPATH="/tmp/ab_$v:/tmp/site" JAX_ATTN_DIST_COMMIT="$v" timeout 200 python3 \
       "$src/benchmarks/bench.py" --no-xla --shapes idx-v32 --json "/tmp/$v$round.json" > "/tmp/$v$round.log" 2>&1) \
      || tail -5 "/tmp/$v$round.log"
    python3 -c "import json; r = json.load(open('/tmp/$v$round.json'))['rows'][0]
print('$v', $round, round(r['kernel_bwd_ms'], 3), round(r['bwd_deterministic_ms'], 3))"
  done
done
