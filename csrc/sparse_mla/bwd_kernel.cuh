// The SM90 sparse MLA backward kernel and its host launcher (the warp roles
// and the shared-memory plan: bwd_config.h; the consumers' steps:
// bwd_steps.cuh; the row preprocess and the deterministic mode's small
// kernels: bwd_rows.cu).
//
// Per key block (64 slots), with lse2 = lse in base 2 and delta =
// rowsum(dO * O) - dlse in base e (both per head):
//   WG0: S = Q.K^T; P = exp2(S sm_scale log2(e) - lse2) on valid slots, into
//        shared memory (bf16).
//   WG1: dP = dO.V^T; dS = P (dP - delta) sm_scale into shared memory (bf16).
//   both: dQ += dS.K over their dim tiles; the key stages are released;
//        dKV = dS^T.Q + P^T.dO, one 64 x 64 tile at a time, each added into
//        the kv gradient row of its slot's key (invalid slots: nothing).
#pragma once

#include <cfloat>
#include <cstdint>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/cluster.cuh"
#include "../common/cta.cuh"
#include "../common/fixed_point.cuh"
#include "../common/gather.cuh"
#include "../common/host.h"
#include "../common/timeline.cuh"
#include "bwd_config.h"
#include "bwd_steps.cuh"
#include "row.cuh"

namespace attn_dist {
namespace sparse_mla {

using namespace cute;
using cutlass::arch::NamedBarrier;

// Timeline events of a block (a timeline build only, common/timeline.cuh;
// tools/timeline.py reads these names). WG0's and WG1's steps differ from
// event 3 on; k*FirstProductDone + MergeStep are the steps of the
// warpgroup's first value tile (its product completed, the partner's landing
// free, the partner's half received); a dKV tile's event is kDkvTileDone + i
// for value tile i of the warpgroup's, + (its value tile count) for the rope
// tile.
enum ScoresMark : int {
  kScoresTop,
  kScoresLanded,      // the block's first key stage landed
  kScoresDone,        // S completed
  kScoresPFree,       // WG1's dKV products no longer read the last P
  kScoresPStored,     // P stored and published
  kScoresDsReady,     // WG1's dS published
  kScoresDqDone,      // its dQ products completed
  kScoresDkvStart,    // its dQ stages and landing freed, its dKV tiles begin
  kScoresFirstProductDone, kScoresFirstLandingFree, kScoresFirstReceived,
  kScoresDkvTileDone,
};
enum GradsMark : int {
  kGradsTop,
  kGradsLanded,       // the block's first key stage landed
  kGradsDpDone,       // dP completed
  kGradsPReady,       // WG0's P published
  kGradsDsFree,       // WG0's dKV products no longer read the last dS
  kGradsDsStored,     // dS stored and published
  kGradsDqDone,
  kGradsDkvStart,
  kGradsFirstProductDone, kGradsFirstLandingFree, kGradsFirstReceived,
  kGradsDkvTileDone,
};
static_assert(kScoresFirstReceived - kScoresFirstProductDone + 1 == kMergeSteps &&
                  kGradsFirstReceived - kGradsFirstProductDone + 1 == kMergeSteps,
              "one event per merge step");
// Each warpgroup's dKV tiles have an event each (WG0 at most 4 with the rope
// tile, WG1 at most 5: bwd_config.h).
static_assert(kScoresDkvTileDone + 4 <= timeline::kEvents && kGradsDkvTileDone + 5 <= timeline::kEvents,
              "a step's events fit the timeline's");
enum GatherMark : int { kStageFilled = 0 /* + dim tile: its stage freed and its copies issued */ };

// WG0: scores and P; dQ over value tiles 0..3 and the rope tile; its dKV tiles.
template <class Cfg, bool kPaired>
__device__ __forceinline__ void consume_scores(typename Cfg::SharedMemoryPlan& plan, const SparseMlaBwdParams& p,
                                               const CtaProblem& c, const FixedTerms& fixed, PairRole<kPaired>& role,
                                               int thread) {
  const int lane = thread % 32;
  Tensor accS = partition_fragment_C(typename Cfg::MmaScores{}, Shape<Int<Cfg::HT>, Int<kBlockTopk>>{});
  Tensor accDq = partition_fragment_C(typename Cfg::MmaDq4{}, Shape<Int<Cfg::HT>, Int<bwd::kDqValueDims>>{});
  Tensor accDqRope = partition_fragment_C(typename Cfg::MmaDq1{}, Shape<Int<Cfg::HT>, Int<kDimTile>>{});
  clear(accDq);
  clear(accDqRope);
  float lse2[2];
  load_lse2<Cfg>(p, c, thread, lse2);
  const int num_blocks = c.slots.num_blocks();
  CUTE_NO_UNROLL
  for (int block = 0; block < num_blocks; ++block) {
    auto mark = [&](int event) { timeline::mark(thread == 0, 0, block, event); };
    mark(kScoresTop);
    const uint32_t phase = block & 1;
    const BlockSlots slots = load_block_slots(c.slots, block, lane);
    issue_scores<Cfg, typename Cfg::SmemLayoutQ, Cfg::kFirstFilledTile>(
        plan, plan.q, plan.q_ready, phase, block == 0, accS, thread, [&](int i) { if (i == 0) mark(kScoresLanded); });
    const KeyRows rows = block_key_rows<Cfg>(p, c, block, thread);
    warpgroup_wait<0>();
    mark(kScoresDone);
    release_dq_stages<Cfg>(plan, role, lane);  // WG1's dQ tiles
    scores_to_p(accS, valid_slot_mask(c.slots, slots), p.scale_log2, lse2, lane);
    if (block > 0) NamedBarrier::sync(bwd::kPairThreads, bwd::kWg1DkvDone);  // WG1 no longer reads P
    mark(kScoresPFree);
    store_tile(plan.p, accS, thread);
    NamedBarrier::arrive(bwd::kPairThreads, bwd::kPReady);
    mark(kScoresPStored);
    NamedBarrier::sync(bwd::kPairThreads, bwd::kDsReady);
    mark(kScoresDsReady);
    issue_dq<Cfg, typename Cfg::MmaDq4, typename Cfg::SmemLayoutK4T>(plan, 0, accDq, thread);
    if constexpr (Cfg::kRopeTiles > 0)
      issue_dq<Cfg, typename Cfg::MmaDq1, typename Cfg::SmemLayoutTileT>(plan, bwd::kValueTiles, accDqRope, thread);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    mark(kScoresDqDone);
    release_stages<Cfg>(plan, 0, bwd::kDqTilesPerConsumer, lane);
    if constexpr (Cfg::kRopeTiles > 0) release_stages<Cfg>(plan, bwd::kValueTiles, Cfg::kRopeTiles, lane);
    landing_free_after_dq(plan.send_free, role, lane);
    if (block == 0) wait_tiles_landed(plan.dout_ready, bwd::kValueTiles);  // P^T.dO reads dO, which WG1 waited for
    mark(kScoresDkvStart);
    dkv_tiles<Cfg>(plan, p, rows, true, 0, Cfg::kWg0ValueTiles, block + 1 < num_blocks, bwd::kWg0DkvDone,
                   fixed, role, thread, [&](int i) { mark(kScoresDkvTileDone + i); },
                   [&](int s) { mark(kScoresFirstProductDone + s); });
  }
  store_dq<Cfg>(p, c, accDq, 0, thread);
  if constexpr (Cfg::kRopeTiles > 0) store_dq<Cfg>(p, c, accDqRope, bwd::kDv, thread);
}

// WG1: dP and dS; dQ over value tiles 4..7; its dKV tiles.
template <class Cfg, bool kPaired>
__device__ __forceinline__ void consume_grads(typename Cfg::SharedMemoryPlan& plan, const SparseMlaBwdParams& p,
                                              const CtaProblem& c, const FixedTerms& fixed, PairRole<kPaired>& role,
                                              int thread) {
  const int lane = thread % 32;
  Tensor accDp = partition_fragment_C(typename Cfg::MmaScores{}, Shape<Int<Cfg::HT>, Int<kBlockTopk>>{});
  Tensor accDq = partition_fragment_C(typename Cfg::MmaDq4{}, Shape<Int<Cfg::HT>, Int<bwd::kDqValueDims>>{});
  clear(accDq);
  float delta[2];
  load_head_values<Cfg>(p.row_delta, p, c, thread, 0.f, delta);
  const int num_blocks = c.slots.num_blocks();
  CUTE_NO_UNROLL
  for (int block = 0; block < num_blocks; ++block) {
    auto mark = [&](int event) { timeline::mark(thread == 0, 1, block, event); };
    mark(kGradsTop);
    const uint32_t phase = block & 1;
    issue_scores<Cfg, typename Cfg::SmemLayoutDO>(plan, plan.dout, plan.dout_ready, phase, block == 0, accDp,
                                                  thread, [&](int i) { if (i == 0) mark(kGradsLanded); });
    const KeyRows rows = block_key_rows<Cfg>(p, c, block, thread);
    warpgroup_wait<0>();
    mark(kGradsDpDone);
    release_stages<Cfg>(plan, 0, bwd::kDqTilesPerConsumer, lane);  // WG0's dQ tiles (the rope stage is WG0's alone)
    NamedBarrier::sync(bwd::kPairThreads, bwd::kPReady);
    mark(kGradsPReady);
    dp_to_ds<Cfg>(plan, accDp, delta, p.sm_scale, thread);
    if (block > 0) NamedBarrier::sync(bwd::kPairThreads, bwd::kWg0DkvDone);  // WG0 no longer reads dS
    mark(kGradsDsFree);
    store_tile(plan.ds, accDp, thread);
    NamedBarrier::arrive(bwd::kPairThreads, bwd::kDsReady);
    mark(kGradsDsStored);
    NamedBarrier::sync(kWarpgroupThreads, bwd::kDsStored);  // for this warpgroup's own WGMMAs
    issue_dq<Cfg, typename Cfg::MmaDq4, typename Cfg::SmemLayoutK4T>(plan, bwd::kDqTilesPerConsumer, accDq,
                                                                          thread);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    mark(kGradsDqDone);
    release_dq_stages<Cfg>(plan, role, lane);
    landing_free_after_dq(plan.send_free, role, lane);
    if (block == 0) wait_tiles_landed(plan.q_ready, Cfg::kDimTiles);  // dS^T.Q reads Q, which WG0 waited for
    mark(kGradsDkvStart);
    dkv_tiles<Cfg>(plan, p, rows, false, Cfg::kWg0ValueTiles, bwd::kValueTiles - Cfg::kWg0ValueTiles,
                   block + 1 < num_blocks, bwd::kWg1DkvDone, fixed, role, thread,
                   [&](int i) { mark(kGradsDkvTileDone + i); }, [&](int s) { mark(kGradsFirstProductDone + s); });
  }
  store_dq<Cfg>(p, c, accDq, bwd::kDqValueDims, thread);
}

// ---------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------
// One kernel per pairing: each keeps only its own dKV merge, so that neither
// path's code shapes the other's registers and schedule.
template <class Cfg, bool kPaired>
__global__ void __launch_bounds__(bwd::kThreads, 1)
    sparse_mla_bwd_kernel(const __grid_constant__ SparseMlaBwdParams params, const __grid_constant__ BwdTmaParams tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Plan = typename Cfg::SharedMemoryPlan;
  extern __shared__ char smem_raw[];
  Plan& plan = aligned_plan<Plan>(smem_raw);
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int thread_in_wg = threadIdx.x % kWarpgroupThreads;
  const CtaProblem cta = locate_cta<Cfg>(params);
  timeline::mark_start();

  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kDimTiles; ++i) cutlass::arch::ClusterTransactionBarrier::init(&plan.q_ready[i], 1);
    for (int i = 0; i < bwd::kValueTiles; ++i)
      cutlass::arch::ClusterTransactionBarrier::init(&plan.dout_ready[i], 1);
    // Both consumers release every value stage; the rope stage only WG0 reads and releases.
    Cfg::Ring::init(plan.ring, [](int, int stage) { return stage < bwd::kValueTiles ? bwd::kNumConsumers : 1; });
    for (int w = 0; w < bwd::kNumConsumers; ++w) {
      cutlass::arch::ClusterBarrier::init(&plan.send_free[w], bwd::kSendFreeArrivals);
      cutlass::arch::ClusterBarrier::init(&plan.recv_full[w], bwd::kRecvFullArrivals);
    }
    cutlass::arch::fence_barrier_init();
  }
  // A pair's CTAs arrive on each other's barriers: both must have set them up.
  if constexpr (kPaired) cute::cluster_sync();
  else __syncthreads();

  if (warpgroup == bwd::kNumConsumers) {
    cutlass::arch::warpgroup_reg_dealloc<bwd::kProducerRegs>();
    // A row with no live block needs no Q or dO: a CTA must not exit with its TMA in flight.
    if (thread_in_wg == 0 && cta.slots.num_blocks() > 0) {
      cute::prefetch_tma_descriptor(&tma.q);
      cute::prefetch_tma_descriptor(&tma.dout);
      load_head_tile_by_tma<Cfg::HT, Cfg::kDimTiles>(plan.q, plan.q_ready, &tma.q, cta);
      load_head_tile_by_tma<Cfg::HT, bwd::kValueTiles>(plan.dout, plan.dout_ready, &tma.dout, cta);
    }
    const bf16* keys = static_cast<const bf16*>(params.kv) + int64_t(cta.batch) * params.s_kv * Cfg::D;
    gather_key_blocks<typename Cfg::Ring, Cfg::D, 1, Cfg::kFirstFilledTile>(
        plan.kv, plan.ring, cta.slots, keys, 0, thread_in_wg,
        [&](int block, int dt) { timeline::mark(thread_in_wg == 0, 2, block, kStageFilled + dt); });
    timeline::mark_end(thread_in_wg == 0, bwd::kNumConsumers);
  } else {
    cutlass::arch::warpgroup_reg_alloc<bwd::kConsumerRegs>();
    FixedTerms fixed;
    if constexpr (Cfg::kDeterministic) {  // this batch element's scale: its rows (every shard's), its bound
      const unsigned bits = params.bound_bits[cta.batch];
      fixed.two_to_f = fixed_point_scale(bits, params.scale_rows).to_fixed;
      fixed.term_limit = __uint_as_float(bits);
      fixed.flag = params.flag_bits + cta.batch;
    }
    PairRole<kPaired> role = pair_role<kPaired>(warpgroup);
    if (warpgroup == 0) consume_scores<Cfg>(plan, params, cta, fixed, role, thread_in_wg);
    else consume_grads<Cfg>(plan, params, cta, fixed, role, thread_in_wg);
    timeline::mark_end(thread_in_wg == 0, warpgroup);
  }
  // Neither CTA of a pair may exit while the other can still reach its shared memory.
  if constexpr (kPaired) cute::cluster_sync();
#elif defined(__CUDA_ARCH__)
  // Built for an architecture without WGMMA/setmaxnreg: fail loudly rather
  // than return gradients that were never written.
  __trap();
#endif
}

// ---------------------------------------------------------------------------
// Host launcher of the main kernel for one variant (the row preprocess and
// the fixed-point kernels: bwd_rows.cu; the order: bwd_launch.cu).
// ---------------------------------------------------------------------------
template <class Cfg>
LaunchStatus run_bwd_variant(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail) {
  BwdTmaParams tma{};
  if (LaunchStatus s = encode_head_tile_map(&tma.q, p.q, Cfg::D, p.h_q, p.s_q, p.batch, Cfg::HT, detail);
      s != LaunchStatus::kOk)
    return s;
  if (LaunchStatus s = encode_head_tile_map(&tma.dout, p.dout, bwd::kDv, p.h_q, p.s_q, p.batch, Cfg::HT, detail);
      s != LaunchStatus::kOk)
    return s;
  const timeline::Recorder timeline(stream);
  const bool paired = Cfg::paired_head_tiles(p.h_q);
  const LaunchStatus status = launch_kernel_clustered(
      paired ? &sparse_mla_bwd_kernel<Cfg, true> : &sparse_mla_bwd_kernel<Cfg, false>,
      int64_t(p.batch) * p.s_q * Cfg::num_head_tiles(p.h_q), paired ? 2u : 1u, bwd::kThreads, Cfg::kSmemBytes,
      stream, detail, p, tma);
  timeline.write(stream);
  return status;
}

}  // namespace sparse_mla
}  // namespace attn_dist

// Explicit instantiation: CMake generates one file with this line per entry of
// the op's variants.py (both modes of each, and each mode's two kernels, one
// per pairing), and nvcc compiles those files up to four to a translation unit.
#define SPARSE_MLA_BWD_INSTANTIATE(D, HT)                                                     \
  template attn_dist::LaunchStatus                                                          \
  attn_dist::sparse_mla::run_bwd_variant<attn_dist::sparse_mla::BwdConfig<D, HT, false>>(   \
      const attn_dist::SparseMlaBwdParams&, cudaStream_t, const char**);                    \
  template attn_dist::LaunchStatus                                                          \
  attn_dist::sparse_mla::run_bwd_variant<attn_dist::sparse_mla::BwdConfig<D, HT, true>>(    \
      const attn_dist::SparseMlaBwdParams&, cudaStream_t, const char**);
