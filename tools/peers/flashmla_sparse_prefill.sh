#!/usr/bin/env bash
# Builds FlashMLA's SM90 sparse prefill forward with flashmla_harness.cu into a
# shared library that tools/peers/time_flashmla.py loads with ctypes (no torch).
#   tools/peers/flashmla_sparse_prefill.sh FLASHMLA_DIR [OUT_SO]
# FLASHMLA_DIR is a FlashMLA checkout (or a copy of the files this build reads:
# LICENSE, csrc/{params,utils,defines}.h, csrc/sm90/helpers.h,
# csrc/sm90/prefill/sparse/{config.h,phase1.h,phase1.cuh,instantiations/phase1_k{576,512}.cu},
# csrc/kerutils/include/); nothing of it is copied here. OUT_SO defaults to
# /tmp/flashmla_harness.so. CUTLASS comes from $CUTLASS_DIR (a CUTLASS source
# tree, with include/ and tools/util/include/), else from the nvidia-cutlass
# package that python3 imports (cutlass_library/source; /tmp/site's if none).
# The compile flags are FlashMLA's setup.py's, for sm_90a only; ptxas's
# register and spill report goes to OUT_SO.log.
set -euo pipefail
src=${1:?usage: $0 FLASHMLA_DIR [OUT_SO]}
so=${2:-/tmp/flashmla_harness.so}
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$src" && pwd)
if [ -z "${CUTLASS_DIR:-}" ]; then
  CUTLASS_DIR=$(python3 -c 'import os, cutlass_library as c; print(os.path.join(os.path.dirname(c.__file__), "source"))' \
                2>/dev/null || echo /tmp/site/cutlass_library/source)
fi
[ -f "$CUTLASS_DIR/include/cute/tensor.hpp" ] || { echo "no CUTLASS headers under $CUTLASS_DIR" >&2; exit 1; }

flags=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -Wno-deprecated-declarations
       -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
       -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
       -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC -lineinfo
       --ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage
       -I "$src/csrc" -I "$src/csrc/kerutils/include" -I "$src/csrc/sm90"
       -I "$CUTLASS_DIR/include" -I "$CUTLASS_DIR/tools/util/include")

obj=$(mktemp -d /tmp/flashmla_build.XXXXXX)
trap 'rm -rf "$obj"' EXIT
sources=("$src/csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu"
         "$src/csrc/sm90/prefill/sparse/instantiations/phase1_k512.cu"
         "$here/flashmla_harness.cu")
pids=()
for f in "${sources[@]}"; do
  nvcc "${flags[@]}" -c "$f" -o "$obj/$(basename "$f" .cu).o" > "$obj/$(basename "$f" .cu).log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { failed=1; echo "== nvcc failed: ${sources[$i]}" >&2; tail -n 40 "$obj/$(basename "${sources[$i]}" .cu).log" >&2; }
done
[ $failed -eq 0 ] || exit 1
cat "$obj"/*.log > "$so.log"
nvcc -shared -o "$so" "$obj"/*.o -lcudart_static
grep -E "Used [0-9]+ registers|spill" "$so.log" | grep -v "0 bytes spill" | sort | uniq -c || true
echo "built $so (FlashMLA $(cat "$src/COMMIT" 2>/dev/null || git -C "$src" rev-parse --short HEAD 2>/dev/null || echo '?'), CUTLASS $CUTLASS_DIR)"
