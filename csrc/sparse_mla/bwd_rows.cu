// The sparse MLA backward's small kernels (bwd_rows.h).
//
// The deterministic mode's bound on one query row's dkv terms, per element:
// a row adds sum over heads h and slots j of
//   |dS_hj| sm_scale |q_hd| + P_hj |dO_hd|,
// with sum_j P_hj <= 1 and |dS_hj| = P_hj |dP_hj - delta_h| where
// |dP_hj| <= ||dO_h||_1 max|kv|. So the row's terms are at most
//   sum_h  sm_scale max|q_h| (||dO_h||_1 max|kv| + |delta_h|) + max|dO_h|
// over the heads that take probability (finite lse), times kRowBoundMargin
// for bf16's rounding of P and dS and float slack. Each batch element has
// its own max |kv|, bound and so scale (a vmapped or B-sharded call gives
// each element the bits it would get alone).
#include <cfloat>
#include <cstdint>

#include <cuda_bf16.h>

#include "../common/fixed_point.cuh"
#include "../common/host.h"
#include "bwd_rows.h"

namespace attn_dist {
namespace sparse_mla {

namespace {

constexpr int kRowThreads = 128;
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kDv = 512;
constexpr float kRowBoundMargin = 4.f;
constexpr int kStreamThreads = 256;
constexpr int64_t kStreamMaxCtas = 4096;  // a few waves; each CTA strides the rest

__device__ __forceinline__ float warp_sum(float x) {
  for (int mask = 16; mask >= 1; mask >>= 1) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int mask = 16; mask >= 1; mask >>= 1) x = nan_keeping_max(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

// 8 bf16 from a 16-byte load.
__device__ __forceinline__ void load8(const __nv_bfloat16* src, float (&x)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}

// One CTA per query row; warp w takes heads w, w + 4, ... Every sum runs in a
// fixed order (the butterflies, then the warps in order): the same bits in
// every run, so the fixed-point scale is too.
template <bool kBound>
__global__ void __launch_bounds__(kRowThreads) row_terms_kernel(const __grid_constant__ SparseMlaBwdParams p) {
  __shared__ float warp_terms[2][kRowWarps];
  const int64_t row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float dlse_to_e = p.lse_base_e ? 1.f : 1.4426950408889634f;  // d lse_e = d lse_2 * log2(e)
  float with_kv_max = 0.f, without = 0.f;  // this warp's share of the row's bound
  for (int h = warp; h < p.h_q; h += kRowWarps) {
    const int64_t head = row * p.h_q + h;
    const auto* o = static_cast<const __nv_bfloat16*>(p.out) + head * kDv;
    const auto* d_o = static_cast<const __nv_bfloat16*>(p.dout) + head * kDv;
    float dot = 0.f, l1 = 0.f, dout_max = 0.f;
    for (int c = lane * 8; c < kDv; c += 32 * 8) {
      float xo[8], xd[8];
      load8(o + c, xo);
      load8(d_o + c, xd);
      for (int i = 0; i < 8; ++i) {
        dot = fmaf(xo[i], xd[i], dot);
        l1 += fabsf(xd[i]);
        dout_max = nan_keeping_max(dout_max, fabsf(xd[i]));
      }
    }
    dot = warp_sum(dot);
    const float delta = dot - p.dlse[head] * dlse_to_e;
    if (lane == 0) p.row_delta[head] = delta;
    if constexpr (kBound) {
      float lse = p.lse[head];
      if (!(fabsf(lse) <= FLT_MAX)) continue;  // the head takes no probability: no terms
      const auto* q = static_cast<const __nv_bfloat16*>(p.q) + head * p.d_qk;
      float q_max = 0.f;
      for (int c = lane * 8; c < p.d_qk; c += 32 * 8) {
        float xq[8];
        load8(q + c, xq);
        for (int i = 0; i < 8; ++i) q_max = nan_keeping_max(q_max, fabsf(xq[i]));
      }
      q_max = warp_max(q_max) * p.sm_scale;
      l1 = warp_sum(l1);
      dout_max = warp_max(dout_max);
      with_kv_max += q_max * l1;
      without += q_max * fabsf(delta) + dout_max;
    }
  }
  if constexpr (kBound) {
    if (lane == 0) warp_terms[0][warp] = with_kv_max, warp_terms[1][warp] = without;
    __syncthreads();
    if (threadIdx.x == 0) {
      float a = 0.f, b = 0.f;
      for (int w = 0; w < kRowWarps; ++w) a += warp_terms[0][w], b += warp_terms[1][w];
      const int batch = int(row / p.s_q);
      const float kv_max = __uint_as_float(p.kv_max_bits[batch]);
      const float bound = kRowBoundMargin * (a * kv_max + b);
      atomicMax(p.bound_bits + batch, bound <= FLT_MAX ? __float_as_uint(bound) : kNonFiniteBoundBits);
    }
  }
}

// max |kv| per batch element (grid y strides the elements, x its chunks of 8
// elements); a NaN records the non-finite bits.
__global__ void __launch_bounds__(kStreamThreads) kv_max_kernel(const __grid_constant__ SparseMlaBwdParams p) {
  const int64_t chunks = int64_t(p.s_kv) * p.d_qk / 8;
  for (int b = blockIdx.y; b < p.batch; b += gridDim.y) {
    const auto* kv = static_cast<const __nv_bfloat16*>(p.kv) + int64_t(b) * p.s_kv * p.d_qk;
    float m = 0.f;
    for (int64_t i = blockIdx.x * int64_t(kStreamThreads) + threadIdx.x; i < chunks;
         i += int64_t(gridDim.x) * kStreamThreads) {
      float x[8];
      load8(kv + i * 8, x);
      for (int k = 0; k < 8; ++k) m = nan_keeping_max(m, fabsf(x[k]));
    }
    m = warp_max(m);
    if (threadIdx.x % 32 == 0 && m > 0.f) atomicMax(p.kv_max_bits + b, __float_as_uint(m));
    if (threadIdx.x % 32 == 0 && m != m) atomicMax(p.kv_max_bits + b, kNonFiniteBoundBits);
  }
}

// dkv = dkv_fixed * 2^-F with each batch element's own F (its S rows).
// (Flags go into bound_bits in one call: flag_bits == bound_bits.)
__global__ void __launch_bounds__(kStreamThreads) fixed_to_float_kernel(const __grid_constant__ SparseMlaBwdParams p) {
  const int64_t n = int64_t(p.s_kv) * p.d_qk;
  for (int b = blockIdx.y; b < p.batch; b += gridDim.y) {
    const FixedPointScale s = fixed_point_scale(p.bound_bits[b], p.scale_rows);
    const int64_t first = int64_t(b) * n;
    for (int64_t i = blockIdx.x * int64_t(kStreamThreads) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * kStreamThreads)
      p.dkv[first + i] = s.finite ? __ll2float_rn(p.dkv_fixed[first + i]) * s.from_fixed : __int_as_float(0x7fc00000);
  }
}

// The float32 dkv from the main kernel's accumulator order back to column
// order, in place, one group of 16 columns per thread: column c of a group
// was stored at 4 ((c % 8) / 2) + 2 (c / 8) + c % 2 (bwd_steps.cuh).
__global__ void __launch_bounds__(kStreamThreads) columns_in_order_kernel(float* dkv, int64_t groups) {
  for (int64_t g = blockIdx.x * int64_t(kStreamThreads) + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * kStreamThreads) {
    float4* at = reinterpret_cast<float4*>(dkv + g * 16);
    const float4 q0 = at[0], q1 = at[1], q2 = at[2], q3 = at[3];  // lanes 0..3 of the quad: 2r, 2r+1, 8+2r, 9+2r
    at[0] = make_float4(q0.x, q0.y, q1.x, q1.y);
    at[1] = make_float4(q2.x, q2.y, q3.x, q3.y);
    at[2] = make_float4(q0.z, q0.w, q1.z, q1.w);
    at[3] = make_float4(q2.z, q2.w, q3.z, q3.w);
  }
}

constexpr int kMaxGridY = 65535;

// A grid over (work per batch element) x B, a few waves in all.
dim3 stream_grid(int64_t work, int batch) {
  const int y = batch < kMaxGridY ? batch : kMaxGridY;
  int64_t x = (work + kStreamThreads - 1) / kStreamThreads;
  const int64_t max_x = kStreamMaxCtas / y > 1 ? kStreamMaxCtas / y : 1;
  x = x < 1 ? 1 : (x > max_x ? max_x : x);
  return dim3(unsigned(x), unsigned(y));
}

}  // namespace

LaunchStatus launch_row_terms(const SparseMlaBwdParams& p, bool with_bound, cudaStream_t stream, const char** detail) {
  const int64_t rows = int64_t(p.batch) * p.s_q;
  if (with_bound) return launch_kernel(&row_terms_kernel<true>, rows, kRowThreads, 0, stream, detail, p);
  return launch_kernel(&row_terms_kernel<false>, rows, kRowThreads, 0, stream, detail, p);
}

LaunchStatus launch_kv_max(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail) {
  return launch_kernel(&kv_max_kernel, stream_grid(int64_t(p.s_kv) * p.d_qk / 8, p.batch), kStreamThreads, 0,
                       stream, detail, p);
}

LaunchStatus launch_dkv_columns_in_order(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail) {
  const int64_t groups = int64_t(p.batch) * p.s_kv * p.d_qk / 16;
  return launch_kernel(&columns_in_order_kernel, stream_grid(groups, 1), kStreamThreads, 0, stream, detail, p.dkv,
                       groups);
}

LaunchStatus launch_dkv_fixed_to_float(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail) {
  return launch_kernel(&fixed_to_float_kernel, stream_grid(int64_t(p.s_kv) * p.d_qk, p.batch), kStreamThreads, 0,
                       stream, detail, p);
}

}  // namespace sparse_mla
}  // namespace attn_dist
