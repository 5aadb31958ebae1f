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

#include "../common/fixed_point.cuh"
#include "params.h"

namespace attn_dist {
namespace indexer {

constexpr float kRowBoundMargin = 4.f;

// Host launchers (bwd_fixed_point.cu), on the stream, before and after the
// main kernel: each row's bound into bound_bits, and dk_fixed * 2^-F into
// d_index_k.
LaunchStatus launch_row_bounds(const IndexerBwdParams& p, cudaStream_t stream, const char** detail);
LaunchStatus launch_fixed_to_float(const IndexerBwdParams& p, cudaStream_t stream, const char** detail);

}  // namespace indexer
}  // namespace attn_dist
