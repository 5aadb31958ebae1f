// The SM90 indexer_kl backward consumer's per-block steps (bwd_kernel.cuh runs
// them): the row's target mass tau, the staging of a block's dK rows in
// shared memory (float32, or deterministic mode's 64-bit fixed-point chunks),
// and the bulk reductions that add the staged rows to d_index_k.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "../common/bulk_reduce.cuh"
#include "bwd_config.h"
#include "fixed_point.cuh"
#include "steps.cuh"

namespace attn_dist {
namespace indexer {

using namespace cute;

// The row's target mass tau = sum of target over its valid slots with
// target > 0 (SPEC §5.2), each thread a strided share, then the warps'
// butterflies and the 4 warps in order: the same value in every thread.
template <class Cfg>
__device__ __forceinline__ float row_target_mass(typename Cfg::SharedMemoryPlan& plan, const IndexerBwdParams& p,
                                                 const CtaProblem& c, int thread_in_wg) {
  const float* target_row = p.target + c.row * p.topk;
  float tau = 0.f;
#pragma unroll 4
  for (int t = thread_in_wg; t < c.slots.topk; t += kWarpgroupThreads) {
    const float x = __ldg(target_row + t);
    if (c.slots.valid(c.slots.load(t)) && x > 0.f) tau += x;
  }
  CUTE_UNROLL
  for (int mask = 16; mask >= 1; mask >>= 1) tau += __shfl_xor_sync(0xffffffffu, tau, mask);
  if (thread_in_wg % 32 == 0) plan.tau[thread_in_wg / 32] = tau;
  consumer_sync();
  float total = 0.f;
  CUTE_UNROLL
  for (int w = 0; w < kConsumerWarps; ++w) total += plan.tau[w];
  return total;
}

// A block's dK rows (acc: 64 keys x DI, WGMMA C layout: value 4j + 2rh + e
// is row r0 + 8rh, dim 8j + 2q + e) into the shared staging rows.
template <class Cfg, class Acc>
__device__ __forceinline__ void stage_dk_rows(typename Cfg::SharedMemoryPlan& plan, const Acc& acc, int r0, int q) {
  CUTE_UNROLL
  for (int j = 0; j < Cfg::DI / 8; ++j)
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh)
      *reinterpret_cast<float2*>(&plan.dk[r0 + 8 * rh][8 * j + 2 * q]) =
          make_float2(acc(4 * j + 2 * rh), acc(4 * j + 2 * rh + 1));
}

// Deterministic mode: dims [32 c, 32 c + 32) of the thread's dK rows as
// fixed-point integers into staging buffer c % 2 (each pair one 16-byte store).
template <class Cfg, class Acc>
__device__ __forceinline__ void stage_dk_fixed_chunk(typename Cfg::SharedMemoryPlan& plan, const Acc& acc, int chunk,
                                                     int r0, int q) {
  constexpr int kPairs = Cfg::kFixedChunkDims / 8;
  const float two_to_f = plan.to_fixed;  // from shared memory: no register held across the loop
  auto& buffer = plan.dk[chunk % Cfg::kFixedBuffers];
  CUTE_UNROLL
  for (int jj = 0; jj < kPairs; ++jj)
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int j = chunk * kPairs + jj;
      *reinterpret_cast<longlong2*>(&buffer[r0 + 8 * rh][8 * jj + 2 * q]) =
          make_longlong2(to_fixed(acc(4 * j + 2 * rh), two_to_f), to_fixed(acc(4 * j + 2 * rh + 1), two_to_f));
    }
}

}  // namespace indexer
}  // namespace attn_dist
