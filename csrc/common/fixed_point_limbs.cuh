// Fixed-point sums (fixed_point.cuh) added across devices. A sum is an int64;
// a collective adds int32 words, and JAX without x64 has no int64 array. So
// each device's sum travels as three 21-bit limbs in int32 words: the two low
// limbs unsigned, the top one signed (|sum| < 2^62, so the top limb is in
// [-2^20, 2^20)). Added word by word over up to kMaxLimbTerms devices, no
// word overflows int32, and the limb sums rejoin (in int64, carries and all)
// into the exact total: the same integer, and so the same float32 bits, as a
// single device's sum over all the rows.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>  // __host__, __device__ for the host compiler too

namespace attn_dist {

constexpr int kFixedPointLimbs = 3;
constexpr int kLimbBits = 21;
constexpr int64_t kLimbMask = (int64_t(1) << kLimbBits) - 1;
// (2^21 - 1) * 1024 < 2^31: the most devices whose limbs add without overflow.
constexpr int kMaxLimbTerms = 1024;
// The most rows a scale is chosen for (fixed_point_scale's ceil_log2 wants
// far fewer than 2^62; 2^40 rows is beyond any call).
constexpr int64_t kMaxScaleRows = int64_t(1) << 40;

__host__ __device__ __forceinline__ void split_limbs(long long sum, int32_t& low, int32_t& mid, int32_t& high) {
  low = int32_t(sum & kLimbMask);
  mid = int32_t((sum >> kLimbBits) & kLimbMask);
  high = int32_t(sum >> (2 * kLimbBits));  // arithmetic shift: the sign stays here
}

__host__ __device__ __forceinline__ long long join_limbs(int32_t low, int32_t mid, int32_t high) {
  return (long long)low + (long long)mid * (1ll << kLimbBits) + (long long)high * (1ll << (2 * kLimbBits));
}

}  // namespace attn_dist
