// Step timelines of the sparse MLA kernels and the resident top-k kernel, for
// diagnosis: with JAX_ATTN_DIST_TIMELINE defined at build time
// (tools/gpu_check.sh timeline builds so, through CMAKE_CUDA_FLAGS, into a
// directory of its own), a kernel's marked steps record the SM clock of one
// thread per role into a buffer, and the launcher writes it to the file that
// the environment variable JAX_ATTN_DIST_TIMELINE_FILE names after the
// launch (synchronising the stream: a timeline build is not for timing whole
// calls, nor for CUDA-graph capture). Without the definition every mark is
// empty and the kernels compile as if it were not there.
//
// Layout of the file: uint32 [kCtas][kRoles][kSteps][kEvents], the first
// kCtas CTAs of the launch, zero where nothing was marked; role kMetaRole,
// step 0 holds the CTA's SM, its start clock and its roles' end clocks
// (tools/timeline.py reads it).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#ifdef JAX_ATTN_DIST_TIMELINE
#include <cstdio>
#include <cstdlib>
#include <vector>
#endif

namespace attn_dist {
namespace timeline {

constexpr int kCtas = 2048;   // the first CTAs of a launch: enough waves of 132 SMs
constexpr int kRoles = 4;     // consumer 0, consumer 1, producer (top-k: the selector), meta
constexpr int kSteps = 32;    // key-block pairs (forward) or blocks (backward)
constexpr int kEvents = 16;
constexpr int kMetaRole = 3;
// Meta slots (role kMetaRole, step 0).
enum Meta : int { kSm = 0, kStart = 1, kRoleEnd = 2 /* + role */ };

// The default of the shared steps' mark callbacks (a stage landed or filled,
// a dKV tile or merge step done): nothing, in every build.
struct NoMark {
  template <class... Args>
  __device__ __forceinline__ void operator()(Args...) const {}
};

#ifdef JAX_ATTN_DIST_TIMELINE
// Internal linkage, all of it: each translation unit's launcher points its
// own kernels' copy of g_marks at its own buffer.
namespace {

__device__ uint32_t* g_marks;

__device__ __forceinline__ uint32_t clock32() {
  uint32_t c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
  return c;
}

__device__ __forceinline__ uint32_t* slot(int role, int step, int event) {
  return g_marks + ((int64_t(blockIdx.x) * kRoles + role) * kSteps + step) * kEvents + event;
}

// The step's event happened now (called by every thread of the role; the
// first thread records).
__device__ __forceinline__ void mark(bool leader, int role, int step, int event) {
  if (leader && g_marks != nullptr && blockIdx.x < kCtas && step < kSteps) *slot(role, step, event) = clock32();
}

__device__ __forceinline__ void mark_start() {
  if (threadIdx.x == 0 && g_marks != nullptr && blockIdx.x < kCtas) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    *slot(kMetaRole, 0, kSm) = sm;
    *slot(kMetaRole, 0, kStart) = clock32();
  }
}

__device__ __forceinline__ void mark_end(bool leader, int role) {
  if (leader && g_marks != nullptr && blockIdx.x < kCtas) *slot(kMetaRole, 0, kRoleEnd + role) = clock32();
}

// Host: around one launch in the kernel's own translation unit.
class Recorder {
 public:
  explicit Recorder(cudaStream_t stream) : path_(std::getenv("JAX_ATTN_DIST_TIMELINE_FILE")) {
    uint32_t* marks = nullptr;
    if (path_ != nullptr) {
      if (buffer() == nullptr) cudaMalloc(&buffer(), kBytes);
      cudaMemsetAsync(buffer(), 0, kBytes, stream);
      marks = buffer();
    }
    cudaMemcpyToSymbolAsync(g_marks, &marks, sizeof(marks), 0, cudaMemcpyHostToDevice, stream);
  }
  void write(cudaStream_t stream) const {
    if (path_ == nullptr || buffer() == nullptr) return;
    std::vector<uint32_t> host(kBytes / sizeof(uint32_t));
    cudaStreamSynchronize(stream);
    cudaMemcpy(host.data(), buffer(), kBytes, cudaMemcpyDeviceToHost);
    if (FILE* f = std::fopen(path_, "wb")) {
      std::fwrite(host.data(), 1, kBytes, f);
      std::fclose(f);
    }
  }

 private:
  static constexpr size_t kBytes = size_t(kCtas) * kRoles * kSteps * kEvents * sizeof(uint32_t);
  static uint32_t*& buffer() {
    static uint32_t* b = nullptr;
    return b;
  }
  const char* path_;
};

}  // namespace

#else

__device__ __forceinline__ void mark(bool, int, int, int) {}
__device__ __forceinline__ void mark_start() {}
__device__ __forceinline__ void mark_end(bool, int) {}
struct Recorder {
  explicit Recorder(cudaStream_t) {}
  void write(cudaStream_t) const {}
};

#endif

}  // namespace timeline
}  // namespace attn_dist
