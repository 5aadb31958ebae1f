// Host-side helpers of the kernel launchers: the TMA map of a query tensor's
// head tile and a launch whose error is the launch's own.
#pragma once

#include <cstdint>
#include <utility>

#include <cuda.h>
#include <cuda_runtime.h>

#include <cutlass/cuda_host_adapter.hpp>

#include "params.h"

namespace attn_dist {

// The TMA element type of a bf16 tensor (elem_bytes 2), or of a 1-byte one
// (float8) read as raw bytes.
inline CUtensorMapDataType tensor_map_type(int elem_bytes) {
  return elem_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// A 4-D map over a row-major [B, S, H, D] tensor of bf16 (elem_bytes 2) or
// of a 1-byte type (float8), dims (D, H, S, B), box (one 128-byte row of
// dims, `head_tile` heads, `rows` query rows, 1), 128-byte swizzle: one WGMMA
// operand tile per copy, its rows ordered (row, head). Heads past H and rows
// past S are zero-filled.
inline LaunchStatus encode_head_tile_map(CUtensorMap* map, const void* base, int D, int H, int S, int B,
                                         int head_tile, const char** detail, int rows = 1, int elem_bytes = 2) {
  const uint64_t dims[4] = {uint64_t(D), uint64_t(H), uint64_t(S), uint64_t(B)};
  const uint64_t row = uint64_t(D) * uint64_t(elem_bytes);  // bytes
  const uint64_t strides[3] = {row, row * uint64_t(H), row * uint64_t(H) * uint64_t(S)};  // dims 1..3
  const uint32_t box[4] = {uint32_t(128 / elem_bytes), uint32_t(head_tile), uint32_t(rows), 1u};
  const uint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, tensor_map_type(elem_bytes), 4, const_cast<void*>(base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    *detail = "cuTensorMapEncodeTiled failed for a head-tile map";
    return LaunchStatus::kTensorMapError;
  }
  return LaunchStatus::kOk;
}

// The current device's SM count and L2 size (0 if a query fails). Plain
// attribute queries: no synchronisation, and nothing that touches the stream,
// which may be capturing a CUDA graph (a stream query there failed the
// capture). The handler runs with the stream's device current, as
// cudaFuncSetAttribute in launch_kernel also assumes.
inline int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) return 0;
  return value;
}
inline int device_sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount); }
inline int64_t device_l2_bytes() { return device_attribute(cudaDevAttrL2CacheSize); }

// Launches `kernel` on a `grid` of CTAs with `smem` bytes of dynamic shared
// memory, in clusters of `cluster_x` consecutive CTAs along x (1: no
// clusters); the error returned is this launch's (cudaLaunchKernelEx), not a
// stale one that cudaGetLastError might report.
template <class... Params, class... Args>
LaunchStatus launch_kernel_clustered(void (*kernel)(Params...), dim3 grid, unsigned cluster_x, int threads, int smem,
                                     cudaStream_t stream, const char** detail, Args&&... args) {
  // Per device, so set on every launch (host-side, no synchronisation). The
  // carveout asks for all of L1 as shared memory: left to itself the driver
  // may pick a split that fits one CTA of a kernel meant to run two per SM.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (err == cudaSuccess) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = size_t(smem);
    config.stream = stream;
    cudaLaunchAttribute cluster[1];
    if (cluster_x > 1) {
      cluster[0].id = cudaLaunchAttributeClusterDimension;
      cluster[0].val.clusterDim.x = cluster_x;
      cluster[0].val.clusterDim.y = 1;
      cluster[0].val.clusterDim.z = 1;
      config.attrs = cluster;
      config.numAttrs = 1;
    }
    err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  }
  if (err != cudaSuccess) {
    *detail = cudaGetErrorString(err);
    return LaunchStatus::kLaunchError;
  }
  return LaunchStatus::kOk;
}

template <class... Params, class... Args>
LaunchStatus launch_kernel(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream,
                           const char** detail, Args&&... args) {
  return launch_kernel_clustered(kernel, grid, 1u, threads, smem, stream, detail, std::forward<Args>(args)...);
}

// A 1-D grid of `grid` CTAs (checked to fit, and to be whole clusters).
template <class... Params, class... Args>
LaunchStatus launch_kernel_clustered(void (*kernel)(Params...), int64_t grid, unsigned cluster_x, int threads,
                                     int smem, cudaStream_t stream, const char** detail, Args&&... args) {
  if (grid <= 0 || grid > INT32_MAX || cluster_x == 0 || grid % cluster_x != 0) {
    *detail = "grid size out of range, or not a whole number of clusters";
    return LaunchStatus::kInvalidProblem;
  }
  return launch_kernel_clustered(kernel, dim3(unsigned(grid)), cluster_x, threads, smem, stream, detail,
                                 std::forward<Args>(args)...);
}

template <class... Params, class... Args>
LaunchStatus launch_kernel(void (*kernel)(Params...), int64_t grid, int threads, int smem, cudaStream_t stream,
                           const char** detail, Args&&... args) {
  return launch_kernel_clustered(kernel, grid, 1u, threads, smem, stream, detail, std::forward<Args>(args)...);
}

}  // namespace attn_dist
