#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, demo, benchmark, sanitizers.
#   tools/gpu_check.sh [build] [test] [test-all] [multi-gpu] [demo] [bench] [bench-quick] [bench-indexer] [bench-packed] [bench-new] [sanitize] [sanitize-det] [sanitize-packed] [sanitize-new] [sanitize-bwd] [timeline] [ncu] [ncu-topk] [sass]
# Logs and JSON go to $OUT (default /tmp/gpu_check), and all of them again in
# $OUT/0_gpu_check.tgz at the end. Needs the nvidia-cutlass
# wheel in .whl/ (no package index there); everything else is on the machine.
#
# GPU test steps run with JAX_ATTN_DIST_REQUIRE_GPU set (1, or 2 for
# multi-gpu): a test that cannot reach the GPU or the kernel fails instead of
# skipping, and a stale or broken extension is an error, not a warning.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test demo bench)
status=()
failed=0
STEP_TIMEOUT=${STEP_TIMEOUT:-300}  # a hung kernel must not eat the whole call
TEST_TIMEOUT=${TEST_TIMEOUT:-570}  # the GPU suite's groups side by side: 300-505 s on an H200 (its slowest group); with build, add about 80 s
BENCH_NEW_TIMEOUT=${BENCH_NEW_TIMEOUT:-540}  # bench-new: 370-380 s on an H200 before the no-remat plain-XLA rows (about a minute more)
unset STEP_LIMIT                   # set per step only (run's override)
run() {  # name, command...  (the step's limit: $STEP_LIMIT if set, else STEP_TIMEOUT)
  local name=$1; shift
  local t0=$SECONDS
  timeout -k 5 "${STEP_LIMIT:-$STEP_TIMEOUT}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  status+=("$name rc=$rc $((SECONDS - t0))s")
  [ $rc -ne 0 ] && failed=1
  echo "== $name rc=$rc ($((SECONDS - t0))s)"; tail -n 25 "$OUT/$name.log"
  return $rc
}
# The GPU tests in groups of about equal time, run side by side on the one GPU
# (their float64 references are CPU work; one after another they take about
# 20 minutes, side by side about 5).
GPU_TEST_GROUPS=("tests/attn_dist/test_gpu.py tests/attn_dist/test_gpu_transforms.py tests/packing/test_gpu.py"
                 "tests/indexer/test_gpu.py tests/package/test_gpu_command_buffers.py tests/package/test_xla_precision.py
                  tests/sparse_mla/test_gpu_poisoned.py"
                 "tests/indexer_topk/test_gpu.py tests/sparse_mla/test_gpu.py"
                 "tests/sparse_mla/test_gpu_backward.py"
                 "tests/dsa/test_gpu.py")
gpu_test_groups() {  # each group's pytest in the background, its log test_<n>.log; fails if any group failed
  local pids=() rc=0 i
  trap 'kill "${pids[@]}" 2>/dev/null' TERM  # the step's time limit ends the groups too
  for i in "${!GPU_TEST_GROUPS[@]}"; do
    # shellcheck disable=SC2086  # a group is a list of files
    JAX_ATTN_DIST_REQUIRE_GPU=1 python3 -m pytest -q -rfEs ${GPU_TEST_GROUPS[$i]} --run-large -p no:cacheprovider \
      > "$OUT/test_$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "group $i: $(tail -n 1 "$OUT/test_$i.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/test_$i.log"
  done
  return $rc
}
for step in "${steps[@]}"; do
  case $step in
    build)
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
      export PYTHONPATH=/tmp/site
      { nvidia-smi; nvcc --version; python3 -c "import jax; print(jax.__version__, jax.devices())"; } > "$OUT/env.log" 2>&1
      # With the test-only poisoned FFI targets (CMakeLists.txt: JAX_ATTN_DIST_TEST_TARGETS).
      run build python3 -m pip install --no-build-isolation --no-deps -v \
        -C cmake.define.JAX_ATTN_DIST_TEST_TARGETS=ON . || exit 1
      grep -E "spill|Used [0-9]+ registers" "$OUT/build.log" | sort | uniq -c
      grep -o "kernel build cache hit.*" "$OUT/build.log"  # then ptxas did not run: no register counts
      # The extension the tests load must be the one just built from this tree.
      run build-id env JAX_ATTN_DIST_REQUIRE_GPU=1 python3 -c "
from jax_attn_dist._core import ext as _ext
m = _ext.extension_module(); here = _ext.build_id_of('.')
print(m.__file__, 'built', m.build_id(), 'checkout', here)
assert m.build_id() == here, 'stale extension'
assert m.test_targets_built(), 'built without the test-only FFI targets'
print(_ext.kernel_unavailable_reason())" || exit 1 ;;
    test) STEP_LIMIT=$TEST_TIMEOUT run test bash "$0" _test_groups ;;
    _test_groups) gpu_test_groups; exit $? ;;  # the test step's body, in a process the time limit can end
    test-all) run test-all env JAX_PLATFORMS=cpu JAX_ATTN_DIST_REQUIRE_GPU=0 python3 -m pytest -q -rs tests \
                -p no:cacheprovider ;;
    multi-gpu) run multi-gpu env JAX_ATTN_DIST_REQUIRE_GPU=2 python3 -m pytest -q -rs tests/sparse_mla/test_gpu_sharding.py \
                 tests/dsa/test_gpu_sharding.py tests/attn_dist/test_gpu_sharding.py \
                 tests/indexer/test_gpu_sharding.py tests/packing/test_gpu_sharding.py tests/attn_dist/test_sharding.py \
                 tests/attn_dist/test_shard_map.py tests/attn_dist/test_sharding_cuda_lowering.py \
                 tests/indexer/test_sharding.py tests/package/test_partitioning.py -p no:cacheprovider
               run shard-map-example python3 examples/shard_map_example.py ;;
    demo) run demo env JAX_ATTN_DIST_REQUIRE_GPU=1 python3 -m jax_attn_dist ;;
    bench) run bench python3 benchmarks/bench.py --json "$OUT/bench.json" ;;
    bench-quick) run bench python3 benchmarks/bench.py --shapes v32-h128 v32-h64 idx-v32 step-v32 \
                   --json "$OUT/bench.json" ;;
    bench-indexer) run bench python3 benchmarks/bench.py --shapes idx-v32 idx-v32-128k step-v32 \
                     --json "$OUT/bench.json" ;;
    bench-packed) run bench-packed python3 benchmarks/bench.py --no-xla --shapes v32-h128 pack-v32-h128 \
                    topk-half-v32-h128 topk-full-v32-h128 pack-idx-v32 topk-half-idx-v32 \
                    topk-full-idx-v32 --json "$OUT/bench_packed.json" ;;
    bench-new) STEP_LIMIT=$BENCH_NEW_TIMEOUT run bench-new python3 benchmarks/bench.py --shapes mla-v32-h128 mla-v32-h64 mla-128k-h128 mla-bwd-v32-h128 \
                 mla-bwd-v32-h64 mla-bwd-det-v32-h128 mla-bwd-det-v32-h64 topk-v32 topk-v32-fp8 \
                 topk-32k topk-128k dsa-layer-v32 --json "$OUT/bench_new.json" ;;
    sanitize)
      for tool in memcheck racecheck synccheck initcheck; do
        for kernel in attn_dist indexer indexer_bwd; do
          case $kernel in attn_dist) name=attn_dist_kernel ;; indexer) name=indexer_fwd_kernel ;; *) name=indexer_bwd_kernel ;; esac
          run "sanitize-$tool-$kernel" compute-sanitizer --tool "$tool" --kernel-name "kns=$name" --error-exitcode 9 \
            python3 tests/support/sanitizer_run.py "$kernel"
        done
      done ;;
    sanitize-det)  # the deterministic backward: its main kernel under every tool, all three under memcheck
      for tool in memcheck racecheck synccheck; do
        run "sanitize-$tool-indexer_bwd_det" compute-sanitizer --tool "$tool" --kernel-name kns=indexer_bwd_kernel \
          --error-exitcode 9 python3 tests/support/sanitizer_run.py indexer_bwd_det
      done
      run "sanitize-memcheck-indexer_bwd_det-all" compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 tests/support/sanitizer_run.py indexer_bwd_det ;;
    sanitize-packed)  # SPEC §6 (row ranges, malformed cu_seqlens, topk_length) on all three kernels
      run "sanitize-memcheck-packed" compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 tests/support/sanitizer_run.py packed
      # Row ranges far past N, the key operands in exact-size allocations: no kernel reads past its own N.
      run "sanitize-memcheck-ranges" compute-sanitizer --tool memcheck --padding 1048576 --error-exitcode 9 \
        python3 tests/support/sanitizer_run.py ranges
      for tool in racecheck synccheck; do
        for name in attn_dist_kernel indexer_fwd_kernel indexer_bwd_kernel; do
          run "sanitize-$tool-packed-$name" compute-sanitizer --tool "$tool" --kernel-name "kns=$name" \
            --error-exitcode 9 python3 tests/support/sanitizer_run.py packed
        done
      done ;;
    sanitize-new)  # sparse_mla's forward kernel and the indexer_topk kernel
      for tool in memcheck racecheck synccheck; do
        for mode in sparse_mla indexer_topk; do
          case $mode in sparse_mla) name=sparse_mla_fwd_kernel ;; *) name=indexer_topk ;; esac  # both top-k kernels
          run "sanitize-$tool-$mode" compute-sanitizer --tool "$tool" --kernel-name "kns=$name" --error-exitcode 9 \
            python3 tests/support/sanitizer_run.py "$mode"
        done
      done ;;
    sanitize-bwd)  # sparse_mla's backward: its main kernel under every tool, all its kernels (and the
                   # deterministic backwards' per-shard steps for sharded rows) under memcheck, and its small
                   # kernels (bwd_rows.cu: the row terms, the one with shared memory and a barrier) under
                   # every tool in a process of their own. Racecheck inside the XLA process fails on their
                   # module ("Internal Sanitizer Error: ... hardware exception", compute-sanitizer 2025.3.1)
                   # whichever of its kernels it is given, one that never runs included, and with eager module
                   # loading before any of ours runs; the same kernels alone run clean under every tool.
      run sanitize-memcheck-sparse_mla_bwd compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 tests/support/sanitizer_run.py sparse_mla_bwd sharded_steps
      for tool in racecheck synccheck; do
        run "sanitize-$tool-sparse_mla_bwd" compute-sanitizer --tool "$tool" --kernel-name kns=sparse_mla_bwd_kernel \
          --error-exitcode 9 python3 tests/support/sanitizer_run.py sparse_mla_bwd
      done
      cutlass=$(python3 -c 'import os, cutlass_library as c; print(os.path.join(os.path.dirname(c.__file__), "source"))' \
                2>/dev/null || echo /tmp/site/cutlass_library/source)
      run bwd-rows-probe-build nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -lineinfo -I csrc \
        -isystem "$cutlass/include" tests/support/bwd_rows_probe.cu csrc/sparse_mla/bwd_rows.cu -o /tmp/bwd_rows_probe &&
      for tool in memcheck racecheck synccheck initcheck; do
        run "sanitize-$tool-bwd_rows" compute-sanitizer --tool "$tool" --error-exitcode 9 /tmp/bwd_rows_probe
      done ;;
    timeline)  # a build with the step marks (common/timeline.cuh), in a directory of its own so that
               # nothing else picks it up; the forward's and the backward's schedules at mla-v32-h128,
               # and the resident float8 top-k kernel's at topk-v32-fp8
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
      run timeline-build env PYTHONPATH=/tmp/site python3 -m pip install --no-build-isolation --no-deps \
        --target /tmp/timeline_site -C build-dir=/tmp/timeline_build \
        -C cmake.define.CMAKE_CUDA_FLAGS=-DJAX_ATTN_DIST_TIMELINE . || exit 1
      for which in fwd bwd; do
        run "timeline-$which" env PYTHONPATH=/tmp/timeline_site:/tmp/site python3 tools/timeline.py mla-v32-h128 \
          "$which" --save "$OUT/timeline_$which.npz"
      done
      run timeline-topk env PYTHONPATH=/tmp/timeline_site:/tmp/site python3 tools/timeline.py topk-v32-fp8 topk \
        --save "$OUT/timeline_topk.npz" ;;
    ncu)
      for shape in v32-h128 v32-h64 idx-v32; do
        run "ncu-$shape" ncu --kernel-name regex:"attn_dist_kernel|indexer_fwd_kernel|indexer_bwd_kernel" --launch-skip 2 \
          --launch-count 1 --set full --import-source no --page details python3 tools/profile_kernel.py "$shape"
      done ;;
    ncu-topk)  # the top-k kernels (float8 resident, bf16 multi-pass): ncu's full set, then each
               # role's instructions and stalls from the per-instruction page (tools/ncu_roles.py)
      for shape in topk-v32-fp8 topk-v32; do
        run "ncu-$shape" ncu --kernel-name regex:indexer_topk --launch-skip 2 --launch-count 1 --set full \
          --import-source no -f -o "$OUT/ncu_$shape" python3 tools/profile_kernel.py "$shape" &&
          run "ncu-source-$shape" bash -c 'ncu -i "$1" --page source --print-source sass --csv > "$2"' _ \
            "$OUT/ncu_$shape.ncu-rep" "$OUT/ncu_${shape}_source.csv" &&
          run "ncu-roles-$shape" python3 tools/ncu_roles.py "$OUT/ncu_${shape}_source.csv" --top 25
      done ;;
    sass)
      so=$(cd /tmp && python3 -c "import jax_attn_dist._cuda as m; print(m.__file__)")
      cuobjdump -sass "$so" | grep -c HGMMA > "$OUT/sass.log" 2>&1; cat "$OUT/sass.log" ;;
  esac
done
echo "== summary"; printf '%s\n' "${status[@]}"
# The device lends back at most 8 files of $OUT (they come back in name
# order): every log and result in one archive whose name sorts first.
tar -czf "/tmp/0_gpu_check_$$.tgz" -C "$OUT" --exclude '0_gpu_check.tgz' . && mv "/tmp/0_gpu_check_$$.tgz" "$OUT/0_gpu_check.tgz"
exit $failed
