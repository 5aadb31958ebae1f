// The SM90 indexer_kl forward kernel and its host launcher.
//
// One CTA per query row (b, s); 2 warpgroups:
//   WG0  consumer. Per block of 64 top-k slots and head tile: 64 x HT x DI
//        WGMMA, then sum_h weights[h] * relu(z) per row (key slot); after the
//        last head tile the row's logit enters an online log-sum-exp and the
//        target sums of the slot's owner thread.
//   WG1  producer: the shared gather pipeline (common/gather.cuh) feeds the
//        index_k rows; one thread loads index_q by TMA.
// At the end the consumer's states are combined in a fixed order (warp
// butterflies, then the 4 warps in order), so the result is deterministic, and
// one thread writes kl and lse.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "steps.cuh"

namespace attn_dist {
namespace indexer {

template <class Cfg>
__device__ __forceinline__ void consume_blocks(typename Cfg::SharedMemoryPlan& plan, const IndexerFwdParams& p,
                                               const CtaProblem& c, int consumer, int thread_in_wg) {
  const int warp = thread_in_wg / 32;
  const int lane = thread_in_wg % 32;
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_slice(thread_in_wg);
  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Cfg::SmemLayoutQ{});                 // (HT, 64, tiles)
  Tensor sK = make_tensor(make_smem_ptr(plan.k[consumer]), typename Cfg::Ring::SmemLayout{});  // (64, 64, stages)
  Tensor tA = thr_mma.partition_fragment_A(sK);
  Tensor tB = thr_mma.partition_fragment_B(sQ);
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockTopk>, Int<Cfg::HT>>{});

  // Lanes with l % 4 == rh own row rh of their quad's pair of rows: its slot's
  // index and target are loaded before the GEMM, and its logit enters `state`.
  const int rh = lane % 4;
  const bool owner = rh < 2;
  const float* target_row = p.target + c.row * p.topk;
  // The owned slot's index and target, loaded kSlotLookahead blocks ahead: a
  // block's GEMM is far shorter than the load's round trip (the target row
  // comes from HBM).
  int32_t ahead_index[kSlotLookahead];
  float ahead_target[kSlotLookahead];
  auto load_slot = [&](int block, int32_t& index, float& target) {
    const int t = block * kBlockTopk + 16 * warp + lane / 4 + 8 * (rh & 1);
    index = owner ? c.slots.load(t) : -1;  // -1 past T
    target = owner && t < p.topk ? __ldg(target_row + t) : 0.f;
  };
  CUTE_UNROLL
  for (int a = 0; a < kSlotLookahead; ++a) load_slot(consumer + a * kNumConsumers, ahead_index[a], ahead_target[a]);
  TileWeights<Cfg> first_tile_weights;
  if constexpr (Cfg::kMaxHeadTiles == 1) first_tile_weights.load(plan.weights, lane);
  RowState state;
  RingPos<Cfg::kStages> pos;
  const int num_blocks = c.slots.num_blocks();
  cutlass::arch::ClusterTransactionBarrier::wait(&plan.q_ready, 0);
  for (int block = consumer; block < num_blocks; block += kNumConsumers) {
    const int32_t index = ahead_index[0];
    const float target = ahead_target[0];
    CUTE_UNROLL
    for (int a = 0; a + 1 < kSlotLookahead; ++a) ahead_index[a] = ahead_index[a + 1], ahead_target[a] = ahead_target[a + 1];
    load_slot(block + kSlotLookahead * kNumConsumers, ahead_index[kSlotLookahead - 1], ahead_target[kSlotLookahead - 1]);
    float partial[2];
    int stage[Cfg::kDimTiles];
    acquire_block<Cfg>(plan, consumer, pos, stage);
    block_logits<Cfg>(plan, mma, tA, tB, acc, c, stage, lane, first_tile_weights, partial);
    release_block<Cfg>(plan, consumer, stage, lane);
    quad_sum(partial);
    if (owner && c.slots.valid(index)) state.add(p.scale * (rh == 0 ? partial[0] : partial[1]), target);
  }
  // Combine: the warp's 32 lanes by a fixed butterfly, then the consumer
  // warps in order by one thread.
  CUTE_UNROLL
  for (int mask = 1; mask < 32; mask <<= 1) state.merge(state.shfl_xor(mask));
  const int consumer_warp = consumer * 4 + warp;
  if (lane == 0) {
    float* out = plan.row_state[consumer_warp];
    out[0] = state.m, out[1] = state.l, out[2] = state.tau, out[3] = state.tx, out[4] = state.tlogt;
  }
  consumer_sync();
  if (consumer == 0 && thread_in_wg == 0) {
    RowState total;
    for (int w = 0; w < kConsumerWarps; ++w) {
      const float* in = plan.row_state[w];
      RowState part;
      part.m = in[0], part.l = in[1], part.tau = in[2], part.tx = in[3], part.tlogt = in[4];
      total.merge(part);
    }
    const float log_l = total.l > 0.f ? logf(total.l) : 0.f;
    p.kl[c.row] = total.tau > 0.f ? total.tlogt - total.tx + total.tau * log_l : 0.f;
    p.lse[c.row] = total.l > 0.f ? total.m + log_l : -INFINITY;
  }
}

// ---------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------
template <class Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kCtasPerSm)
    indexer_fwd_kernel(const __grid_constant__ IndexerFwdParams params, const __grid_constant__ TmaParams tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int thread_in_wg = threadIdx.x % kWarpgroupThreads;
  const CtaProblem cta = locate_cta<Cfg>(params);
  auto& plan = init_plan<Cfg>(smem_raw);

  if (warpgroup == kNumConsumers) {
    if constexpr (Cfg::kProducerRegs > 0) cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    produce_row<Cfg, kSlotLookahead>(plan, params, tma, cta, thread_in_wg);
  } else {
    if constexpr (Cfg::kConsumerRegs > 0) cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    load_row_weights<Cfg>(plan, params, cta);
    consume_blocks<Cfg>(plan, params, cta, warpgroup, thread_in_wg);
  }
#elif defined(__CUDA_ARCH__)
  // Built for an architecture without WGMMA: fail loudly rather than return
  // an output that was never written.
  __trap();
#endif
}

// ---------------------------------------------------------------------------
// Host launcher for one (DI, HT, max head tiles) variant.
// ---------------------------------------------------------------------------
template <class Cfg>
LaunchStatus run_variant(const IndexerFwdParams& p, cudaStream_t stream, const char** detail) {
  return launch_per_row<Cfg>(&indexer_fwd_kernel<Cfg>, p, stream, detail);
}

}  // namespace indexer
}  // namespace attn_dist

// Explicit instantiation: CMake generates one file with this line per entry of the op's
// variants.py, and nvcc compiles those files up to four to a translation unit.
#define INDEXER_FWD_INSTANTIATE(DI, HT, TILES)                                                            \
  template attn_dist::LaunchStatus                                                                         \
  attn_dist::indexer::run_variant<attn_dist::indexer::Config<DI, HT, TILES>>(const attn_dist::IndexerFwdParams&, \
                                                                             cudaStream_t, const char**);
