// The sparse MLA forward's consumer steps (the loop that calls them:
// kernel.cuh): the scores' WGMMAs, the running-max softmax, P (a consumer's
// own from registers, the other's through shared memory) and the P.V
// WGMMAs, and the stages' release.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/cta.cuh"
#include "../common/gather.cuh"
#include "config.h"
#include "scores.cuh"

namespace attn_dist {
namespace sparse_mla {

using namespace cute;

// exp2(a - b) for a row max b that may be -inf (no valid slot yet): then
// every term is 0 and any factor will do.
__device__ __forceinline__ float exp2_diff(float a, float b) { return b == -INFINITY ? 1.f : fast_exp2(a - b); }

// ---------------------------------------------------------------------------
// Consumer steps (WG0, WG1). Accumulator layout (64 x N, f32): thread
// (warp w, lane l) holds rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1);
// acc(4j + 2*rh + e) is row 16w + l/4 + 8rh, column 8j + 2(l%4) + e.
// ---------------------------------------------------------------------------

template <class Cfg>
__device__ __forceinline__ bf16* p_tile(typename Cfg::SharedMemoryPlan& plan, int buffer) {
  if constexpr (Cfg::kHasRopeTile) {
    return buffer == 0 ? plan.kv[0] + (Cfg::kDimTiles - 1) * kBlockTopk * kDimTile : plan.p.tile[0];
  } else {
    return plan.p.tile[buffer];
  }
}

// Stage `dim_tile` of `buffer` has been read by this warpgroup.
template <class Cfg>
__device__ __forceinline__ void release(typename Cfg::SharedMemoryPlan& plan, int buffer, int first_tile,
                                        int num_tiles, int lane) {
  CUTE_UNROLL
  for (int i = 0; i < num_tiles; ++i) release_stage<typename Cfg::Ring>(plan.ring, buffer, first_tile + i, lane);
}

// After a P.V: this warpgroup's value half of `buffer` (tiles first_tile ..
// + 3) has been read, and this warpgroup is done with the even block's P
// where it lives in buffer 0's rope stage (WG0 wrote it, WG1's P0 . V0 read
// it).
template <class Cfg>
__device__ __forceinline__ void release_after_pv(typename Cfg::SharedMemoryPlan& plan, int buffer, int first_tile,
                                                 int lane) {
  release<Cfg>(plan, buffer, first_tile, kVTilesPerConsumer, lane);
  if constexpr (Cfg::kHasRopeTile) {
    if (buffer == 0) release<Cfg>(plan, 0, Cfg::kDimTiles - 1, 1, lane);
  }
}

template <class Cfg>
__device__ __forceinline__ void wait_landed(typename Cfg::SharedMemoryPlan& plan, int buffer, int first_tile,
                                            int num_tiles, uint32_t phase) {
  for (int i = 0; i < num_tiles; ++i) cutlass::arch::ClusterBarrier::wait(&plan.ring.full[buffer][first_tile + i], phase);
}

// accS = Q . K^T over all dim tiles of `buffer` (issued, not waited for).
template <class Cfg, int kFirstTile = 0, class Acc, class OnLanded = timeline::NoMark>
__device__ __forceinline__ void issue_scores(typename Cfg::SharedMemoryPlan& plan, int buffer, uint32_t phase,
                                             bool first_block, Acc& accS, int thread, OnLanded on_landed = {}) {
  issue_block_scores<typename Cfg::MmaQK, typename Cfg::SmemLayoutQ, typename Cfg::Ring::SmemLayout, kFirstTile>(
      plan.q, plan.q_ready, plan.kv[buffer], plan.ring.full[buffer], phase, first_block, accS, thread, on_landed);
}

// Invalid slots' scores become -inf (the others stay unscaled: the scale is
// folded into the exponent); returns the block's max of this thread's two
// rows in base 2 (quad-reduced). sm_scale > 0, so the max of the scaled
// scores is the scaled max.
template <class Acc>
__device__ __forceinline__ void mask_row_max(Acc& accS, uint64_t valid, float scale_log2, float (&row_max)[2],
                                             int lane) {
  row_max[0] = row_max[1] = -INFINITY;
  if (valid == ~uint64_t(0)) {  // warp-uniform (a ballot): the common block, nothing to mask
    for_each_acc_element(lane, [&](int i, int rh, int) { row_max[rh] = fmaxf(row_max[rh], accS(i)); });
  } else {
    for_each_acc_element(lane, [&](int i, int rh, int col) {
      const float x = (valid >> col) & 1 ? accS(i) : -INFINITY;
      accS(i) = x;
      row_max[rh] = fmaxf(row_max[rh], x);
    });
  }
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    row_max[rh] = fmaxf(row_max[rh], __shfl_xor_sync(0xffffffffu, row_max[rh], 1));
    row_max[rh] = fmaxf(row_max[rh], __shfl_xor_sync(0xffffffffu, row_max[rh], 2));
    row_max[rh] *= scale_log2;
  }
}

// P = exp2(S scale_log2 - ref) in place for the accumulator's elements
// [first, last), added to this thread's share of the row sums (in element
// order). A reference of -inf (no valid slot yet) leaves every term 0.
template <class Acc>
__device__ __forceinline__ void exponentiate(Acc& accS, int first, int last, const float (&ref)[2],
                                             float scale_log2, float (&row_sum)[2]) {
  float offset[2];
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) offset[rh] = ref[rh] == -INFINITY ? 0.f : -ref[rh];
  CUTE_UNROLL
  for (int i = first; i < last; ++i) {
    const int rh = (i >> 1) & 1;
    accS(i) = fast_exp2(fmaf(accS(i), scale_log2, offset[rh]));
    row_sum[rh] += accS(i);
  }
}

// The softmax's reference (the max it exponentiates against) moves only when
// a row max passes it by more than this (base 2): P stays <= 2^8, exact in
// bf16's relative precision, and O is rescaled only in the rare pairs that
// move it.
constexpr float kRescaleThreshold = 8.f;
__device__ __forceinline__ float next_reference(float ref, float pair_max) {
  return pair_max > ref + kRescaleThreshold ? pair_max : ref;
}

template <class Acc>
__device__ __forceinline__ void rescale_rows(Acc& acc, const float (&factor)[2]) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) acc(i) *= factor[(i >> 1) & 1];
}

// The B operand of a P.V: this consumer's four value tiles of `buffer`.
template <class Cfg, class TiledMma>
__device__ __forceinline__ auto value_fragment(typename Cfg::SharedMemoryPlan& plan, TiledMma& mma, int buffer,
                                               int consumer, int thread) {
  Tensor sV = make_tensor(make_smem_ptr(plan.kv[buffer] + consumer * kVTilesPerConsumer * kBlockTopk * kDimTile),
                          typename Cfg::SmemLayoutV{});
  return mma.get_slice(thread).partition_fragment_B(sV);
}

// O[:, half] += P . V of the other consumer's block (issued and committed,
// not waited for), P's A operand from its shared tile.
template <class Cfg, class AccO>
__device__ __forceinline__ void issue_pv(typename Cfg::SharedMemoryPlan& plan, int buffer, int consumer,
                                         AccO& accO, int thread) {
  typename Cfg::MmaPV mma;
  Tensor sP = make_tensor(make_smem_ptr(p_tile<Cfg>(plan, buffer)), typename Cfg::SmemLayoutP{});
  Tensor tP = mma.get_slice(thread).partition_fragment_A(sP);
  Tensor tV = value_fragment<Cfg>(plan, mma, buffer, consumer, thread);
  warpgroup_fence_operand(accO);
  warpgroup_arrive();
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tP); ++kb) cute::gemm(mma, tP(_, _, kb), tV(_, _, kb), accO);
  warpgroup_commit_batch();
  warpgroup_fence_operand(accO);
}

// What a consumer ends with: its output half, row max and row-sum share.
template <class Cfg>
struct ConsumerState {
  decltype(partition_fragment_C(typename Cfg::MmaPV{}, Shape<Int<Cfg::HT>, Int<kDvPerConsumer>>{})) accO;
  // The softmax's reference (base 2): the running row max, or up to
  // kRescaleThreshold below it; -inf while no valid slot.
  float reference[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
};

using cutlass::arch::NamedBarrier;

// O[:, half] += P . V of the consumer's own block, P from registers (RS
// WGMMA), written 16 keys at a time: each 64 x 16 block of the scores is
// exponentiated against the pair's reference (O already rescaled to it),
// rounded into its A fragment (element i is the score accumulator's element
// i) and its k-step issued. ptxas keeps the first k-step's issue right after
// its 16 keys but moves the later k-steps' exponentials ahead of their
// issues (SASS), so the product starts after 16 keys' exponentials instead
// of 64's. Committed as one group, not waited for; until that wait nothing
// may read the fragment's registers (PTX leaves it undefined): accS keeps P
// in float32, and store_p_tile rounds it again.
template <class Cfg, class Acc>
__device__ __forceinline__ void own_p_pv(typename Cfg::SharedMemoryPlan& plan, ConsumerState<Cfg>& st, Acc& accS,
                                         const float (&ref)[2], float scale_log2, int buffer, int thread) {
  typename Cfg::MmaPVRegs mma;
  Tensor tV = value_fragment<Cfg>(plan, mma, buffer, /*consumer=*/buffer, thread);
  Tensor tP = make_accumulator_a_fragment<typename Cfg::MmaPVRegs, kBlockTopk>();
  static_assert(decltype(size(tP))::value == decltype(size(accS))::value, "P's A fragment is its accumulator");
  constexpr int kSteps = decltype(size<2>(tP))::value;  // the k-steps, k slowest in the fragment
  static_assert(kSteps == kBlockTopk / 16, "one k-step per 16 keys");
  constexpr int kPerStep = decltype(size(accS))::value / kSteps;  // a 64 x 16 block's elements
  warpgroup_fence_operand(st.accO);
  CUTE_UNROLL
  for (int kb = 0; kb < kSteps; ++kb) {
    exponentiate(accS, kb * kPerStep, (kb + 1) * kPerStep, ref, scale_log2, st.row_sum);
    CUTE_UNROLL
    for (int i = kb * kPerStep; i < (kb + 1) * kPerStep; i += 2) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(accS(i), accS(i + 1));
      tP(i) = bf16::bitcast(__bfloat16_as_ushort(v.x));
      tP(i + 1) = bf16::bitcast(__bfloat16_as_ushort(v.y));
    }
    warpgroup_fence_operand(tP);
    warpgroup_arrive();  // this k-step's fragment written (the earlier k-steps may still run)
    cute::gemm(mma, tP(_, _, kb), tV(_, _, kb), st.accO);
    warpgroup_fence_operand(accS);  // the next k-step's exponentials after this issue (in PTX)
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tP);
  warpgroup_fence_operand(st.accO);
}

// The own block's P into its shared tile for the other consumer, rounded
// from the float32 scores as the fragment was (the same bits), while the own
// P . V runs.
template <class Cfg, class Acc>
__device__ __forceinline__ void store_p_tile(typename Cfg::SharedMemoryPlan& plan, const Acc& accS, int buffer,
                                             int thread) {
  const int warp = thread / 32, lane = thread % 32;
  store_acc_tile(p_tile<Cfg>(plan, buffer), accS, 16 * warp + lane / 4, lane);  // a SmemLayoutP tile
}

// The block's P tile (store_p_tile's stores) published for the other consumer.
__device__ __forceinline__ void publish_p(uint32_t ready_barrier) {
  cutlass::arch::fence_view_async_shared();  // the other consumer's WGMMAs read P through the async proxy
  NamedBarrier::arrive(kPairThreads, ready_barrier);
}

// A consumer's own block (`buffer`, its P published on ready_barrier): P
// formed and its P . V issued from registers, then its tile stored and
// published for the other consumer while that product runs. on_issued()
// follows the issue, on_published() the publication (timeline marks).
template <class Cfg, class Acc, class OnIssued, class OnPublished>
__device__ __forceinline__ void own_block_pv(typename Cfg::SharedMemoryPlan& plan, ConsumerState<Cfg>& st,
                                             Acc& accS, const float (&ref)[2], float scale_log2, int buffer,
                                             uint32_t ready_barrier, int thread, OnIssued on_issued,
                                             OnPublished on_published) {
  own_p_pv<Cfg>(plan, st, accS, ref, scale_log2, buffer, thread);
  on_issued();
  store_p_tile<Cfg>(plan, accS, buffer, thread);
  publish_p(ready_barrier);
  on_published();
}

// The reference moves to `ref` (the same in both consumers): O and the row
// sums follow, O only where a row of this warp moved (a warp-uniform test).
template <class Cfg>
__device__ __forceinline__ void rescale_to(ConsumerState<Cfg>& st, const float (&ref)[2]) {
  float factor[2];
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    factor[rh] = exp2_diff(st.reference[rh], ref[rh]);
    st.row_sum[rh] *= factor[rh];
    st.reference[rh] = ref[rh];
  }
  if (__any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f)) rescale_rows(st.accO, factor);
}

}  // namespace sparse_mla
}  // namespace attn_dist
