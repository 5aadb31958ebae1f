// 64-bit fixed-point sums that give the same bits in any order, for the
// deterministic backward passes (the indexer's d_index_k, sparse_mla's dkv).
//
// A sum whose terms come from many CTAs in a run-dependent order is not
// reproducible in float32. Here each term x becomes the integer
// round(x * 2^F) and the integers are added with 64-bit atomics: integer
// addition is exact and associative, so the sum is the same in every order.
// F is chosen on the device before the sums start, from a bound on every
// row's terms (max-reduced into bound_bits as float bits, an order-free
// integer max): with rows * max_row_bound < 2^(62 - F) no element or
// partial sum overflows, and each term is rounded by at most 2^-(F+1).
#pragma once

#include <cfloat>
#include <cstdint>

namespace attn_dist {

// bound_bits holds this when any bound or term is not finite: the sum is
// then NaN everywhere (loudly, rather than a silently dropped NaN term).
constexpr unsigned kNonFiniteBoundBits = 0x7f800000u;  // +inf

__host__ __device__ constexpr int ceil_log2(int64_t n) {
  int e = 0;
  while ((int64_t(1) << e) < n) ++e;
  return e;
}

struct FixedPointScale {
  float to_fixed;    // 2^F
  float from_fixed;  // 2^-F
  bool finite;       // false: some bound or term was not finite
};

// The same F in every CTA and kernel of a call: a function of the max-reduced
// bound (exact: an integer max of the float bits) and the row count.
__device__ __forceinline__ FixedPointScale fixed_point_scale(unsigned bound_bits, int64_t rows) {
  FixedPointScale s;
  s.finite = bound_bits < kNonFiniteBoundBits;
  int e = 0;
  frexpf(__uint_as_float(s.finite ? bound_bits : 0u), &e);  // bound < 2^e (bound 0: e = 0)
  // 2^F and 2^-F stay normal floats: F is at least 62 - 128 - 31 and at most 126
  // (a smaller bound than 2^-64 / rows gains nothing worth the range).
  const int F = min(62 - e - ceil_log2(rows), 126);
  s.to_fixed = s.finite ? ldexpf(1.f, F) : 0.f;
  s.from_fixed = ldexpf(1.f, -F);
  return s;
}

// A term as a fixed-point integer, given 2^F (cvt.rni: nearest; |x| 2^F < 2^62 by the bound).
__device__ __forceinline__ long long to_fixed(float x, float two_to_f) { return __float2ll_rn(x * two_to_f); }

// max(a, b) that keeps a NaN (fmaxf drops it): a NaN bound must reach bound_bits.
__device__ __forceinline__ float nan_keeping_max(float a, float b) { return b > a || b != b ? b : a; }

// Records a non-finite term or bound: the final conversion then writes NaN.
__device__ __forceinline__ void flag_non_finite(unsigned* bound_bits) { atomicMax(bound_bits, kNonFiniteBoundBits); }

}  // namespace attn_dist
