// How fast can an H100 add rows into a small float32 (or int64) plane in L2,
// and does the instruction form matter? The indexer backward's time follows
// the bytes of its d_index_k reductions (docs/PERFORMANCE.md §16); this
// measures those reductions alone, with no GEMM or gather beside them.
//
// Each variant adds R rows of DI = 128 elements, at uniformly random keys of
// an [N, DI] plane (idx-v32: R = 4096 x 2048, N = 8192: a 4 MiB plane that
// stays in L2), and reports payload bytes per second:
//   bulk_f32   one cp.reduce.async.bulk .add.f32 of a 512-byte row from shared
//              memory per thread (what the backward issues)
//   red_v4     one warp per row, red.global.add.v4.f32: 32 lanes x 16 bytes
//   red_f32    one warp per row, four coalesced scalar red.global.add.f32
//   bulk_u64   the deterministic mode's rows: 1 KiB of .add.u64 per thread
//   red_u64    one warp per 1 KiB row, four coalesced red.global.add.u64
//   store_v4   one warp per row, plain st.global.v4 (a write, for scale)
// and, for the backward's mix of traffic, bulk_f32 beside gathers: half the
// CTAs run bulk_f32, the other half read R random 256-byte rows of an
// [N, 128] bf16 array (the gathered index_k rows, 2 GiB at idx-v32), first
// each alone, then both in one launch:
//   gather     the reading CTAs alone
//   bulk_half  the reducing CTAs alone
//   mixed      both at once
//
//   nvcc -std=c++17 -O3 -arch=sm_90a tools/l2_reduce_bench.cu -o /tmp/l2_reduce_bench
//   /tmp/l2_reduce_bench [ctas_per_sm ...]       (default: 2 4 8)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <type_traits>
#include <vector>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e = (x);                                                                \
    if (e != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

constexpr int kDI = 128;
constexpr int kThreads = 128;
constexpr int kPendingGroups = 8;

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Rows first, first + stride, ... of `keys`: the thread adds a row of a
// 32 KiB shared source to plane[key] by one bulk reduction (512 bytes of
// float32 or 1 KiB of int64), at most kPendingGroups groups unread.
template <class T>
__device__ __forceinline__ void bulk_reduce_rows(T* plane, const int* keys, int64_t rows, int64_t first,
                                                 int64_t stride) {
  constexpr int kRows = 32 * 1024 / int(kDI * sizeof(T));
  __shared__ alignas(128) T src[kRows][kDI];
  for (int i = threadIdx.x; i < kRows * kDI; i += kThreads)
    (&src[0][0])[i] = std::is_same_v<T, float> ? T(1e-3f * float(i % 7)) : T(i % 7);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  int n = 0;
  for (int64_t r = first; r < rows; r += stride) {
    T* dst = plane + int64_t(__ldg(keys + r)) * kDI;
    const uint32_t row = smem_addr(src[threadIdx.x % kRows]);
    if constexpr (std::is_same_v<T, float>)
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(row),
                   "r"(kDI * 4)
                   : "memory");
    else
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;" ::"l"(dst), "r"(row),
                   "r"(kDI * 8)
                   : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (++n % kPendingGroups == 0) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPendingGroups) : "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// bulk_f32 (T = float) and bulk_u64 (T = long long).
template <class T>
__global__ void __launch_bounds__(kThreads) bulk_rows(T* plane, const int* keys, int64_t rows) {
  bulk_reduce_rows(plane, keys, rows, int64_t(blockIdx.x) * kThreads + threadIdx.x, int64_t(gridDim.x) * kThreads);
}

// One warp per row from here on.
template <int kVariant>
__global__ void __launch_bounds__(kThreads) warp_rows(void* plane_v, const int* keys, int64_t rows) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  const float v = 1e-3f * float(lane % 7);
  for (int64_t r = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int key = __ldg(keys + r);
    if constexpr (kVariant == 0) {  // red_v4
      float* p = static_cast<float*>(plane_v) + int64_t(key) * kDI + 4 * lane;
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v), "f"(v), "f"(v), "f"(v)
                   : "memory");
    } else if constexpr (kVariant == 1) {  // red_f32
      float* p = static_cast<float*>(plane_v) + int64_t(key) * kDI + lane;
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + 32 * i), "f"(v) : "memory");
    } else if constexpr (kVariant == 2) {  // red_u64
      long long* p = static_cast<long long*>(plane_v) + int64_t(key) * kDI + lane;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        asm volatile("red.global.add.u64 [%0], %1;" ::"l"(p + 32 * i), "l"((unsigned long long)(lane % 7)) : "memory");
    } else {  // store_v4
      float4* p = reinterpret_cast<float4*>(static_cast<float*>(plane_v) + int64_t(key) * kDI) + lane;
      *p = make_float4(v, v, v, v);
    }
  }
}

// Blocks [0, grid / 2) reduce as bulk_f32 does, blocks [grid / 2, grid) read
// rows by warps (ld.global.cg: from L2, as the gather's cp.async.cg); `roles`
// 1: reduce only, 2: read only, 3: both.
__global__ void __launch_bounds__(kThreads) mixed(float* plane, const uint2* rows_bf16, const int* keys, int64_t rows,
                                                  int roles, float* sink) {
  const int half = gridDim.x / 2;
  if (blockIdx.x < half) {
    if (roles & 1)
      bulk_reduce_rows(plane, keys, rows, int64_t(blockIdx.x) * kThreads + threadIdx.x, int64_t(half) * kThreads);
  } else {
    if (!(roles & 2)) return;
    const int lane = threadIdx.x % 32;
    const int64_t warps = int64_t(half) * (kThreads / 32);
    uint32_t acc = 0;
    // 4 rows in flight per warp: a gather keeps several loads outstanding.
    for (int64_t r = int64_t(blockIdx.x - half) * (kThreads / 32) + threadIdx.x / 32; r < rows; r += 4 * warps) {
      uint2 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t rr = r + u * warps;
        const int key = rr < rows ? __ldg(keys + (rows - 1 - rr)) : 0;  // other keys than the reducers'
        v[u] = __ldcg(rows_bf16 + int64_t(key) * (kDI * 2 / 8) + lane);  // 32 lanes x 8 B = one 256-byte row
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y;
    }
    if (acc == 0x12345678u) sink[0] = 1.f;  // keeps the loads
  }
}

int main(int argc, char** argv) {
  std::vector<int> ctas_per_sm;
  for (int i = 1; i < argc; ++i) ctas_per_sm.push_back(std::atoi(argv[i]));
  if (ctas_per_sm.empty()) ctas_per_sm = {2, 4, 8};
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t rows = int64_t(4096) * 2048;
  std::mt19937 gen(1234);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  // The best of 3 timed launches after a warm-up, each from a zeroed plane.
  auto best_of_3 = [&](void* plane, size_t plane_bytes, auto&& launch) {
    CHECK(cudaMemset(plane, 0, plane_bytes));
    launch();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int rep = 0; rep < 3; ++rep) {
      CHECK(cudaEventRecord(start));
      launch();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      best = ms < best ? ms : best;
    }
    return best;
  };
  for (int num_keys : {8192, 131072}) {
    std::uniform_int_distribution<int> pick(0, num_keys - 1);
    std::vector<int> keys(rows);
    for (auto& k : keys) k = pick(gen);
    int* d_keys = nullptr;
    void* d_plane = nullptr;
    const size_t plane_bytes = size_t(num_keys) * kDI * 8;
    CHECK(cudaMalloc(&d_keys, rows * sizeof(int)));
    CHECK(cudaMalloc(&d_plane, plane_bytes));
    CHECK(cudaMemcpy(d_keys, keys.data(), rows * sizeof(int), cudaMemcpyHostToDevice));
    for (int per_sm : ctas_per_sm) {
      const int grid = sms * per_sm;
      struct Variant {
        const char* name;
        double row_bytes;
        void (*launch)(int, void*, const int*, int64_t);
      };
      const Variant variants[] = {
          {"bulk_f32", kDI * 4.0, [](int g, void* p, const int* k, int64_t r) { bulk_rows<<<g, kThreads>>>(static_cast<float*>(p), k, r); }},
          {"red_v4", kDI * 4.0, [](int g, void* p, const int* k, int64_t r) { warp_rows<0><<<g, kThreads>>>(p, k, r); }},
          {"red_f32", kDI * 4.0, [](int g, void* p, const int* k, int64_t r) { warp_rows<1><<<g, kThreads>>>(p, k, r); }},
          {"bulk_u64", kDI * 8.0, [](int g, void* p, const int* k, int64_t r) { bulk_rows<<<g, kThreads>>>(static_cast<long long*>(p), k, r); }},
          {"red_u64", kDI * 8.0, [](int g, void* p, const int* k, int64_t r) { warp_rows<2><<<g, kThreads>>>(p, k, r); }},
          {"store_v4", kDI * 4.0, [](int g, void* p, const int* k, int64_t r) { warp_rows<3><<<g, kThreads>>>(p, k, r); }},
      };
      for (const Variant& v : variants) {
        const float best = best_of_3(d_plane, plane_bytes, [&] { v.launch(grid, d_plane, d_keys, rows); });
        const double gb = rows * v.row_bytes / 1e9;
        std::printf("N=%6d ctas/SM=%d %-9s %6.2f GB in %7.3f ms: %5.2f TB/s\n", num_keys, per_sm, v.name, gb, best,
                    gb / best);
      }
    }
    {  // the backward's mix: reductions beside gathers of 256-byte rows
      uint2* d_rows = nullptr;
      float* d_sink = nullptr;
      CHECK(cudaMalloc(&d_rows, size_t(num_keys) * kDI * 2));
      CHECK(cudaMalloc(&d_sink, sizeof(float)));
      CHECK(cudaMemset(d_rows, 0, size_t(num_keys) * kDI * 2));
      for (int per_sm : ctas_per_sm) {
        const int grid = 2 * sms * per_sm;  // per_sm CTAs of each role per SM
        const char* names[] = {"", "bulk_half", "gather", "mixed"};
        for (int roles : {1, 2, 3}) {
          const float best = best_of_3(d_plane, plane_bytes, [&] {
            mixed<<<grid, kThreads>>>(static_cast<float*>(d_plane), d_rows, d_keys, rows, roles, d_sink);
          });
          std::printf("N=%6d ctas/SM=%d+%d %-9s reduce %4.2f GB, gather %4.2f GB in %7.3f ms\n", num_keys, per_sm,
                      per_sm, names[roles], roles & 1 ? rows * kDI * 4.0 / 1e9 : 0.0,
                      roles & 2 ? rows * kDI * 2.0 / 1e9 : 0.0, best);
        }
      }
      CHECK(cudaFree(d_rows));
      CHECK(cudaFree(d_sink));
    }
    CHECK(cudaFree(d_keys));
    CHECK(cudaFree(d_plane));
  }
  return 0;
}
