// The deterministic indexer backward's two small kernels (fixed_point.cuh):
// the per-row bounds that set the fixed-point scale, and the final
// conversion of the integer sums to float32.
#include <algorithm>

#include <cuda_bf16.h>

#include "../common/host.h"
#include "fixed_point.cuh"

namespace attn_dist {
namespace indexer {

constexpr int kBoundThreads = 128;
constexpr int kConvertThreads = 256;
constexpr int64_t kConvertMaxCtas = 4096;  // a few waves; each CTA strides the rest

// One CTA per row: A = sum_t |target| (a fixed-order sum: the same bits every
// run), R = max_d sum_h |w_h| |q_hd|, and the row's bound max-reduced into
// bound_bits (an integer max of non-negative float bits: order-free).
__global__ void __launch_bounds__(kBoundThreads) row_bound_kernel(const __grid_constant__ IndexerBwdParams p) {
  __shared__ float warp_a[kBoundThreads / 32];
  __shared__ float warp_r[kBoundThreads / 32];
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;

  const float* t = p.target + row * p.topk;
  float a = 0.f;
  for (int j = tid; j < p.topk; j += kBoundThreads) a += fabsf(__ldg(t + j));

  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.index_q) + row * p.h_idx * p.d_idx;
  const float* w = p.weights + row * p.h_idx;
  float r = 0.f;
  for (int d = tid; d < p.d_idx; d += kBoundThreads) {
    float s = 0.f;
    for (int h = 0; h < p.h_idx; ++h) s = fmaf(fabsf(__ldg(w + h)), fabsf(__bfloat162float(q[h * p.d_idx + d])), s);
    r = nan_keeping_max(r, s);
  }
  for (int mask = 16; mask >= 1; mask >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, mask);
    r = nan_keeping_max(r, __shfl_xor_sync(0xffffffffu, r, mask));
  }
  if (tid % 32 == 0) warp_a[tid / 32] = a, warp_r[tid / 32] = r;
  __syncthreads();
  if (tid == 0) {
    float a_row = 0.f, r_row = 0.f;
    for (int w_ = 0; w_ < kBoundThreads / 32; ++w_) {
      a_row += warp_a[w_];
      r_row = nan_keeping_max(r_row, warp_r[w_]);
    }
    const float bound = kRowBoundMargin * p.scale * fabsf(p.g[row]) * a_row * r_row;
    atomicMax(p.bound_bits, bound <= FLT_MAX ? __float_as_uint(bound) : kNonFiniteBoundBits);
  }
}

// d_index_k = dk_fixed * 2^-F, two elements per thread and step (DI is even).
__global__ void __launch_bounds__(kConvertThreads) fixed_to_float_kernel(const __grid_constant__ IndexerBwdParams p,
                                                                        int64_t pairs) {
  const FixedPointScale s = fixed_point_scale(*p.bound_bits, p.scale_rows);
  const longlong2* src = reinterpret_cast<const longlong2*>(p.dk_fixed);
  float2* dst = reinterpret_cast<float2*>(p.d_index_k);
  for (int64_t i = blockIdx.x * int64_t(kConvertThreads) + threadIdx.x; i < pairs;
       i += int64_t(gridDim.x) * kConvertThreads) {
    const longlong2 v = src[i];
    dst[i] = s.finite ? make_float2(__ll2float_rn(v.x) * s.from_fixed, __ll2float_rn(v.y) * s.from_fixed)
                      : make_float2(NAN, NAN);
  }
}

LaunchStatus launch_row_bounds(const IndexerBwdParams& p, cudaStream_t stream, const char** detail) {
  return launch_kernel(&row_bound_kernel, int64_t(p.batch) * p.s_q, kBoundThreads, 0, stream, detail, p);
}

LaunchStatus launch_fixed_to_float(const IndexerBwdParams& p, cudaStream_t stream, const char** detail) {
  const int64_t pairs = int64_t(p.batch) * p.s_kv * p.d_idx / 2;
  if (pairs == 0) return LaunchStatus::kOk;
  const int64_t ctas = std::min<int64_t>((pairs + kConvertThreads - 1) / kConvertThreads, kConvertMaxCtas);
  return launch_kernel(&fixed_to_float_kernel, ctas, kConvertThreads, 0, stream, detail, p, pairs);
}

}  // namespace indexer
}  // namespace attn_dist
