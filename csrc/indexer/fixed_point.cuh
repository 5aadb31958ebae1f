// The deterministic indexer backward's 64-bit fixed-point sums (SPEC §5.3).
//
// d_index_k[i] sums one term per slot that selects key i, from any rows, so
// float32 atomics give a run-dependent order and run-dependent last bits. In
// the deterministic mode each term x becomes the integer round(x * 2^F) and
// the integers are added with 64-bit atomics: integer addition is exact and
// associative, so the sum is the same in every order. F is chosen on the
// device before the sums start, from a bound on every row's terms:
//   |term| summed over a row's slots <= 2 |g| scale A R  (per dim), with
//   A = sum_t |target[t]|  (covers tau and every t, and sum_t p_t <= 1),
//   R = max_d sum_h |weights[h]| |index_q[h, d]|,
// times kRowBoundMargin for bf16's rounding of dz and float slack. Then every
// element of d_index_k, and every partial sum, is below rows * max_row_bound,
// and F = 62 - ceil(log2(rows * max_row_bound)) keeps it below 2^62: no
// overflow, and each term is rounded by at most 2^-(F+1) (SPEC §5.3's bound).
#pragma once

#include <cfloat>
#include <cstdint>

#include "params.h"

namespace attn_dist {
namespace indexer {

constexpr float kRowBoundMargin = 4.f;
// bound_bits holds this when any bound or term is not finite: d_index_k is
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

// Records a non-finite term or bound: the final conversion then writes NaN.
__device__ __forceinline__ void flag_non_finite(unsigned* bound_bits) { atomicMax(bound_bits, kNonFiniteBoundBits); }

// Host launchers (bwd_fixed_point.cu), on the stream, before and after the
// main kernel: each row's bound into bound_bits, and dk_fixed * 2^-F into
// d_index_k.
LaunchStatus launch_row_bounds(const IndexerBwdParams& p, cudaStream_t stream, const char** detail);
LaunchStatus launch_fixed_to_float(const IndexerBwdParams& p, cudaStream_t stream, const char** detail);

}  // namespace indexer
}  // namespace attn_dist
