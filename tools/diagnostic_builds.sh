#!/usr/bin/env bash
# Diagnostic builds, not product builds (docs/PERFORMANCE.md §14, §16). Each
# variant is a copy of this tree with one or two lines patched; all are built
# and then timed in one call, two rounds, with this checkout's benchmark.
# Patched builds compute wrong results: they are for timing only. On the
# device, in the repo root:
#   [SHAPES="idx-v32 ..."] bash tools/diagnostic_builds.sh VARIANT ...
# PATCH_ONLY=1 (anywhere): patch the copies in /tmp/v_VARIANT and stop.
# BUILD_ONLY=1: build each variant into /tmp/ab_VARIANT and stop (for ncu).
# Variants (indexer backward unless said):
#   shipped        this tree
#   share_5_6      float32 mode: reduce 5/6 of the slots' dK rows (§14)
#   share_3_5      float32 mode: 3/5 of them (§14)
#   share_0        float32 mode: none (§14)
#   u32, f32       deterministic mode: its bytes sent as .add.u32 / .add.f32 (§16)
#   half_rows      float32 mode: the first half of each dK row only (§16)
#   f32_twice      float32 mode: each row into its own row and its
#                  neighbour's (N even): the deterministic bytes (§16)
#   no_cvt         deterministic mode: a bit cast for the int64 conversion (§16)
#   red6           both modes: every 6th slot's reduction dropped (§16)
#   gather6        every 6th slot zero-filled instead of gathered, in the
#                  pipeline attn_dist shares (§16)
#   both6          red6 and gather6 (§16)
#   no_wait        float32 mode: no wait for the last block's reductions to
#                  have read the dK staging rows before they are rewritten (§19)
#   det_no_wait    deterministic mode: likewise for its chunk buffers (§19)
#   stages_m1      attn_dist's rings one stage shorter (HT = 128: 4 instead of
#                  5, HT = 64: 8 instead of 9): how much ring depth matters (§25)
#   no_gather      every slot zero-filled, no key row read: the kernel
#                  without its L2 gather (§27)
#   no_mma         attn_dist's consumers issue one WGMMA a block instead of
#                  D / 16: the kernel without its tensor work (§27)
#   old            the tree in $OLD_TAR (a git archive), unpatched: the
#                  previous build beside the variants (§20; that section's
#                  persistent-grid variants live on branch exp/persistent-attn-dist)
# Prints, per variant, round and shape, the kernel times the rows carry.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=4
src=$PWD
bwd=csrc/indexer/bwd_kernel.cuh fixed=csrc/indexer/fixed_point.cuh gather=csrc/common/gather.cuh
# The lines the variants patch (sed patterns) and what they become.
f32_row='if (row_key >= 0) reduce_row_async(d_keys + int64_t(row_key) \* DI, plan.dk\[r\], DI \* int(sizeof(float)));'
share() { echo "s|$f32_row|if (row_key >= 0 \&\& ($1)) reduce_row_async(d_keys + int64_t(row_key) * DI, plan.dk[r], DI * int(sizeof(float)));|"; }
u64='bulk_group.add.u64'
row_key='const int32_t row_key = plan.row_key\[r\];'
cvt='return __float2ll_rn(x \* two_to_f);'
valid='valid\[r\] = offset\[r\] < slots.key_span;'
red6="$bwd|s|$row_key|const int32_t row_key = (block * 64 + r) % 6 != 0 ? plan.row_key[r] : -1;|"
gather6="$gather|s|$valid|valid[r] = offset[r] < slots.key_span \&\& (block * 64 + row0 + kRowStep * r) % 6 != 0;|"
declare -A patches=(  # variant: "file|sed" entries, separated by newlines
  [shipped]=""
  [share_5_6]="$bwd|$(share '(block * 64 + r) % 6 != 0')"
  [share_3_5]="$bwd|$(share '(block * 64 + r) % 5 >= 2')"
  [share_0]="$bwd|$(share 'false')"
  [u32]="$bwd|s|$u64|bulk_group.add.u32|"
  [f32]="$bwd|s|$u64|bulk_group.add.f32|"
  [half_rows]="$bwd|s|$f32_row|if (row_key >= 0) reduce_row_async(d_keys + int64_t(row_key) * DI, plan.dk[r], DI / 2 * int(sizeof(float)));|"
  [f32_twice]="$bwd|s|$f32_row|if (row_key >= 0) { reduce_row_async(d_keys + int64_t(row_key) * DI, plan.dk[r], DI * int(sizeof(float))); reduce_row_async(d_keys + int64_t(row_key ^ 1) * DI, plan.dk[r], DI * int(sizeof(float))); }|"
  [no_cvt]="$fixed|s|$cvt|return (long long)__float_as_int(x) + (long long)__float_as_int(two_to_f);|"
  [red6]="$red6"
  [gather6]="$gather6"
  [both6]="$red6
$gather6"
  [no_wait]="$bwd|s/if (reducer) wait_reductions_read();/;/"
  [det_no_wait]="$bwd|s/if (reducer) wait_reductions_read<Cfg::kFixedBuffers - 1>();/;/"
  [stages_m1]="csrc/attn_dist/config.h|s|(kNumConsumers \* 64 \* kDimTile \* 2);|(kNumConsumers * 64 * kDimTile * 2) - 1;|"
  [no_gather]="$gather|s|$valid|valid[r] = false;|"
  [no_mma]="csrc/attn_dist/kernel.cuh|s|cute::gemm(mma, tA(_, _, kb, pos.stage), tB(_, _, kb, dt), acc);|if (dt == 0 \&\& kb == 0) cute::gemm(mma, tA(_, _, kb, pos.stage), tB(_, _, kb, dt), acc);|"
  [old]=""
)
variants=("$@")
[ ${#variants[@]} -gt 0 ] || { sed -n '2,/^set /{/^#/p}' "$0"; exit 2; }
read -r -a shapes <<< "${SHAPES:-idx-v32}"
# Every patch must change its file, or the variant would time the shipped code.
patch_tree() {  # variant, tree
  local entry file expr
  while IFS= read -r entry; do
    [ -n "$entry" ] || continue
    file=${entry%%|*} expr=${entry#*|}
    cp "$2/$file" "$2/$file.orig"
    sed -i "$expr" "$2/$file"
    cmp -s "$2/$file" "$2/$file.orig" && { echo "$1: the patch of $file found nothing: update this script"; return 1; }
    rm "$2/$file.orig"
  done <<< "${patches[$1]}"
}
for v in "${variants[@]}"; do [ -v "patches[$v]" ] || { echo "unknown variant $v"; exit 2; }; done
[ -n "${PATCH_ONLY:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/nvidia_cutlass*.whl
build() {  # into /tmp/ab_VARIANT, which exists only if this build succeeded
  rm -rf "/tmp/v_$1" "/tmp/ab_$1" && mkdir -p "/tmp/v_$1" || return 1
  if [ "$1" = old ]; then tar -xf "${OLD_TAR:?set OLD_TAR for the old variant}" -C "/tmp/v_$1"
  elif [ -n "${PATCH_ONLY:-}" ]; then cp -r "$src"/csrc "/tmp/v_$1/"; else cp -r "$src"/. "/tmp/v_$1/" && rm -rf "/tmp/v_$1/build"; fi ||
    return 1
  patch_tree "$1" "/tmp/v_$1" || return 1
  [ -z "${PATCH_ONLY:-}" ] || return 0
  (cd "/tmp/v_$1" && PYTHONPATH=/tmp/site python3 -m pip install -q --no-build-isolation --no-deps \
     --target "/tmp/ab_$1" . > "/tmp/b_$1.log" 2>&1) || { tail -20 "/tmp/b_$1.log"; rm -rf "/tmp/ab_$1"; return 1; }
}
for v in "${variants[@]}"; do build "$v" & done
wait
[ -z "${PATCH_ONLY:-}${BUILD_ONLY:-}" ] || exit 0
for round in $(seq "${ROUNDS:-2}"); do
  for v in "${variants[@]}"; do
    [ -d "/tmp/ab_$v" ] || { echo "$v: not built, not timed"; continue; }
    (cd /tmp && PYTHONPATH="/tmp/ab_$v:/tmp/site" JAX_ATTN_DIST_COMMIT="$v" timeout 300 python3 \
       "$src/benchmarks/bench.py" --no-xla --shapes "${shapes[@]}" --json "/tmp/$v$round.json" > "/tmp/$v$round.log" 2>&1) \
      || { tail -5 "/tmp/$v$round.log"; continue; }
    python3 -c "import json
for r in json.load(open('/tmp/$v$round.json'))['rows']:
    print('$v', $round, r['name'], *(f'{k} {r[k]:.3f}' for k in ('kernel_ms', 'kernel_bwd_ms', 'bwd_deterministic_ms') if k in r))"
  done
done
