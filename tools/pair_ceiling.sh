#!/usr/bin/env bash
# Diagnostic, not a product build (docs/PERFORMANCE.md §16): the most that a
# backward CTA over two query rows could save on the idx-v32 lists, where a
# key both rows select is gathered once and reduced once. Adjacent rows share
# about a third of their keys there (0.83 distinct keys per slot over two
# rows, §5), so such a CTA sends 5/6 of today's gathers and reductions. Each
# variant drops every sixth slot's gather (zero-filled instead), its
# reduction, or both; the gradients are then wrong: timing only. The gather
# patch is in the shared pipeline, so SHAPES=v32-h64 asks the same of attn_dist
# (same index generator, same overlap).
#   [SHAPES="idx-v32"] bash tools/pair_ceiling.sh [variant ...]   (shipped red6 gather6 both6)
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=4
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/nvidia_cutlass*.whl
src=$PWD
kernel=csrc/indexer/bwd_kernel.cuh gather=csrc/common/gather.cuh
red='const int32_t row_key = plan.row_key\[r\];'
gat='valid\[r\] = offset\[r\] < slots.key_span;'
[ "$(grep -c "$red" $kernel)" = 2 ] && grep -q "$gat" $gather || { echo "the patched lines moved: update this script"; exit 1; }
red_patch="s|$red|const int32_t row_key = (block * 64 + r) % 6 != 0 ? plan.row_key[r] : -1;|"
gat_patch="s|$gat|valid[r] = offset[r] < slots.key_span \&\& (block * 64 + row0 + kRowStep * r) % 6 != 0;|"
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(shipped red6 gather6 both6)
read -r -a shapes <<< "${SHAPES:-idx-v32}"
build() {
  rm -rf "/tmp/v_$1" && mkdir -p "/tmp/v_$1" && cp -r "$src"/. "/tmp/v_$1/" && rm -rf "/tmp/v_$1/build"
  case $1 in
    red6) sed -i "$red_patch" "/tmp/v_$1/$kernel" ;;
    gather6) sed -i "$gat_patch" "/tmp/v_$1/$gather" ;;
    both6) sed -i "$red_patch" "/tmp/v_$1/$kernel" && sed -i "$gat_patch" "/tmp/v_$1/$gather" ;;
  esac
  (cd "/tmp/v_$1" && PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps \
     --target "/tmp/ab_$1" . > "/tmp/b_$1.log" 2>&1) || tail -20 "/tmp/b_$1.log"
}
for v in "${variants[@]}"; do build "$v" & done
wait
for round in 1 2; do
  for v in "${variants[@]}"; do
    (cd /tmp && PYTHONPATH="/tmp/ab_$v:/tmp/site" JAX_ATTN_DIST_COMMIT="$v" timeout 200 python3 \
       "$src/benchmarks/bench.py" --no-xla --shapes "${shapes[@]}" --json "/tmp/$v$round.json" > "/tmp/$v$round.log" 2>&1) \
      || tail -5 "/tmp/$v$round.log"
    python3 -c "import json
for r in json.load(open('/tmp/$v$round.json'))['rows']:
    print('$v', $round, r['name'], *(f'{k} {r[k]:.3f}' for k in ('kernel_ms', 'kernel_bwd_ms', 'bwd_deterministic_ms') if k in r))"
  done
done
