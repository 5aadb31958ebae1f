// The SM90 attn_dist kernel and its host launcher.
//
// One CTA per (batch, query token, head tile of HT heads); 4 warpgroups:
//   WG0, WG1  consumers. Both hold the whole head tile; WG0 takes the even key
//             blocks of 64 top-k slots, WG1 the odd ones. Per block: 64xHTxD
//             WGMMA over the D/64 dim tiles, then p = exp2(acc*scale - lse),
//             the per-group head sum (a row sum), and a store of 64 floats per group.
//   WG2, WG3  producers. The shared gather pipeline (common/gather.cuh): WG2
//             gathers the K rows of WG0's blocks, WG3 those of WG1's. One
//             thread loads Q by TMA.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/cta.cuh"
#include "../common/gather.cuh"
#include "../common/host.h"
#include "../common/prefetch.cuh"
#include "../common/slot_validity.cuh"
#include "config.h"

namespace attn_dist {
namespace dist {

using namespace cute;

template <class Cfg>
__device__ __forceinline__ HeadTileCta tile_of_cta(const AttnDistParams& p, int linear) {
  return head_tile_cta(linear, Cfg::num_head_tiles(p.h_q), p.s_q);
}

// Per-CTA facts shared by producer and consumers.
struct CtaProblem : HeadTileCta {
  RowSlots slots;
};

template <class Cfg>
__device__ __forceinline__ CtaProblem locate_cta(const AttnDistParams& p) {
  CtaProblem c;
  static_cast<HeadTileCta&>(c) = tile_of_cta<Cfg>(p, blockIdx.x);
  c.slots = make_row_slots(p.indices, c.batch, c.s, p.s_q, p.topk, p.s_kv, p.causal, p.q_start, p.k_stride,
                           p.row_ranges);
  return c;
}

// ---------------------------------------------------------------------------
// Producer steps (WG2, WG3).
// ---------------------------------------------------------------------------
// What the CTA that takes this one's place next (kCtasPerSm = 1) reads first:
// its Q rows (144 KiB at HT = 128, the longest wait of a CTA's start), slot
// indices and lse, asked for at this CTA's start. The launcher turns it on
// only where it measured a gain (run_variant).
template <class Cfg>
__device__ __forceinline__ void prefetch_next_cta(const AttnDistParams& p) {
  const int64_t next = int64_t(blockIdx.x) + resident_ctas(kCtasPerSm);
  if (next >= gridDim.x) return;
  const HeadTileCta tile = tile_of_cta<Cfg>(p, int(next));
  const int64_t token = int64_t(tile.batch) * p.s_q + tile.s;
  const int head0 = tile.head_tile * Cfg::HT;
  const int heads = min(Cfg::HT, p.h_q - head0);
  const int64_t tokens = int64_t(p.batch) * p.s_q;
  prefetch_elems_to_l2(static_cast<const bf16*>(p.q), tokens * p.h_q * p.d_qk, (token * p.h_q + head0) * p.d_qk,
                       int64_t(heads) * p.d_qk);
  prefetch_elems_to_l2(p.indices, tokens * p.topk, token * p.topk, p.topk);
  prefetch_elems_to_l2(p.lse, tokens * p.h_q, token * p.h_q + head0, heads);
}

// ---------------------------------------------------------------------------
// Consumer steps (WG0, WG1).
// ---------------------------------------------------------------------------

// Per accumulator column (head): -lse in base 2, or -inf where the head does
// not exist (past H) or its lse is not finite, so that p is exactly 0 there.
template <class Cfg>
__device__ __forceinline__ void load_neg_lse(float (&neg_lse)[Cfg::HT / 8][2], const AttnDistParams& p,
                                             const CtaProblem& c, int lane) {
  const float* lse_row = p.lse + (int64_t(c.batch) * p.s_q + c.s) * p.h_q;
  CUTE_UNROLL
  for (int j = 0; j < Cfg::HT / 8; ++j) {
    CUTE_UNROLL
    for (int e = 0; e < 2; ++e) {
      const int head = c.head_tile * Cfg::HT + 8 * j + 2 * (lane % 4) + e;
      float v = head < p.h_q ? __ldg(lse_row + head) : INFINITY;
      if (p.lse_base_e) v *= 1.4426950408889634f;  // log2(e)
      neg_lse[j][e] = isfinite(v) ? -v : -INFINITY;
    }
  }
}

// acc = K_block . Q^T over all dim tiles, releasing each stage as soon as the
// WGMMAs that read it have completed.
template <class Cfg, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void qk_gemm_block(typename Cfg::SharedMemoryPlan& plan, TiledMma& mma,
                                              const FragA& tA, const FragB& tB, Acc& acc, int consumer,
                                              bool first_block, RingPos<Cfg::kStages>& pos, int lane) {
  using Ring = typename Cfg::Ring;
  int prev_stage = -1;
  CUTE_NO_UNROLL
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt) {
    if (first_block) cutlass::arch::ClusterTransactionBarrier::wait(&plan.q_ready[dt], 0);
    wait_stage_full<Ring>(plan.ring, consumer, pos);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    mma.accumulate_ = dt == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tA); ++kb) {
      cute::gemm(mma, tA(_, _, kb, pos.stage), tB(_, _, kb, dt), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(acc);
    if (prev_stage >= 0) {
      warpgroup_wait<1>();  // the previous dim tile's WGMMAs are done with its stage
      release_stage<Ring>(plan.ring, consumer, prev_stage, lane);
    }
    prev_stage = pos.stage;
    pos.advance();
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  release_stage<Ring>(plan.ring, consumer, prev_stage, lane);
}

// p = exp2(acc * scale - lse_2); per row (key slot) and 64-head group, the sum
// over the group's heads; written to out[b, g, s, t], 0 for invalid slots.
//
// WGMMA 64xN f32 accumulator layout: thread (warp w, lane l) holds rows
// 16w + l/4 (+8) and columns 8j + 2(l%4) (+1); acc(4j + 2*rh + e) is row
// 16w + l/4 + 8rh, column 8j + 2(l%4) + e.
template <class Cfg, class Acc>
__device__ __forceinline__ void softmax_sum_store(const Acc& acc, const float (&neg_lse)[Cfg::HT / 8][2],
                                                  const AttnDistParams& p, const CtaProblem& c, int block,
                                                  int warp, int lane, bool row_valid0, bool row_valid1) {
  constexpr int kColGroupsPerHeadGroup = kHeadsPerGroup / 8;
  float row_sum[2][Cfg::kGroupsPerTile];
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    CUTE_UNROLL
    for (int gi = 0; gi < Cfg::kGroupsPerTile; ++gi) {
      float sum = 0.f;
      CUTE_UNROLL
      for (int jj = 0; jj < kColGroupsPerHeadGroup; ++jj) {
        const int j = gi * kColGroupsPerHeadGroup + jj;
        if (j >= Cfg::HT / 8) break;  // HT = 96: the second group has 32 columns in the tile
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) sum += fast_exp2(fmaf(acc(4 * j + 2 * rh + e), p.scale_log2, neg_lse[j][e]));
      }
      // The 4 lanes of a quad hold the row's other columns: a fixed-order butterfly.
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      row_sum[rh][gi] = sum;
    }
  }
  // Lane l % 4 = 2 * gi + rh writes (row rh, group gi): one float per lane.
  const int quad = lane % 4;
  const int rh = quad & 1;
  const int gi = quad >> 1;
  if (gi >= Cfg::kGroupsPerTile) return;
  const int g = c.head_tile * Cfg::kGroupsPerTile + gi;
  const int t = block * kBlockTopk + 16 * warp + lane / 4 + 8 * rh;
  if (g >= p.num_groups || t >= p.topk) return;
  float value = row_sum[0][0];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r)
    CUTE_UNROLL
    for (int q = 0; q < Cfg::kGroupsPerTile; ++q)
      if (r == rh && q == gi) value = row_sum[r][q];
  const bool valid = rh == 0 ? row_valid0 : row_valid1;
  p.out[((int64_t(c.batch) * p.num_groups + g) * p.s_q + c.s) * p.topk + t] = valid ? value : 0.f;
}

// Slots from first_slot on belong to blocks past the row's live slots
// (topk_length, SPEC §6.1), which were skipped: their outputs are 0. Both
// consumer warpgroups share the stores (`thread` in 0 .. 255), coalesced.
template <class Cfg>
__device__ __forceinline__ void store_skipped_slots(const AttnDistParams& p, const CtaProblem& c, int first_slot,
                                                    int thread) {
  constexpr int kStoreThreads = kNumConsumers * kWarpgroupThreads;
  CUTE_UNROLL
  for (int gi = 0; gi < Cfg::kGroupsPerTile; ++gi) {
    const int g = c.head_tile * Cfg::kGroupsPerTile + gi;
    if (g >= p.num_groups) break;
    float* row = p.out + ((int64_t(c.batch) * p.num_groups + g) * p.s_q + c.s) * p.topk;
    for (int t = first_slot + thread; t < p.topk; t += kStoreThreads) row[t] = 0.f;
  }
}

template <class Cfg>
__device__ __forceinline__ void consume_blocks(typename Cfg::SharedMemoryPlan& plan, const AttnDistParams& p,
                                               const CtaProblem& c, int consumer, int thread_in_wg) {
  const int warp = thread_in_wg / 32;
  const int lane = thread_in_wg % 32;
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_slice(thread_in_wg);
  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Cfg::SmemLayoutQ{});                 // (HT, 64, D/64)
  Tensor sK = make_tensor(make_smem_ptr(plan.k[consumer]), typename Cfg::Ring::SmemLayout{});  // (64, 64, stages)
  Tensor tA = thr_mma.partition_fragment_A(sK);
  Tensor tB = thr_mma.partition_fragment_B(sQ);
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockTopk>, Int<Cfg::HT>>{});

  float neg_lse[Cfg::HT / 8][2];
  load_neg_lse<Cfg>(neg_lse, p, c, lane);

  RingPos<Cfg::kStages> pos;
  const int num_blocks = c.slots.num_blocks();
  for (int block = consumer; block < num_blocks; block += kNumConsumers) {
    // This thread's two rows' slot indices; the loads overlap the GEMM.
    const int t0 = block * kBlockTopk + 16 * warp + lane / 4;
    const int32_t index0 = c.slots.load(t0);
    const int32_t index1 = c.slots.load(t0 + 8);
    qk_gemm_block<Cfg>(plan, mma, tA, tB, acc, consumer, block == consumer, pos, lane);
    softmax_sum_store<Cfg>(acc, neg_lse, p, c, block, warp, lane, c.slots.valid(index0), c.slots.valid(index1));
  }
  store_skipped_slots<Cfg>(p, c, num_blocks * kBlockTopk, consumer * kWarpgroupThreads + thread_in_wg);
}

// ---------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------
template <class Cfg>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    attn_dist_kernel(const __grid_constant__ AttnDistParams params, const __grid_constant__ TmaParams tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Plan = typename Cfg::SharedMemoryPlan;
  extern __shared__ char smem_raw[];
  Plan& plan = aligned_plan<Plan>(smem_raw);
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int thread_in_wg = threadIdx.x % kWarpgroupThreads;
  const CtaProblem cta = locate_cta<Cfg>(params);

  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kDimTiles; ++i)
      cutlass::arch::ClusterTransactionBarrier::init(&plan.q_ready[i], 1);
    Cfg::Ring::init(plan.ring);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup >= kNumConsumers) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    const int producer_thread = int(threadIdx.x) - kNumConsumers * kWarpgroupThreads;
    // A row with no live block (topk_length <= 0) needs no Q, and no
    // consumer would wait for it: a CTA must not exit with its TMA in flight.
    if (producer_thread == 0 && cta.slots.num_blocks() > 0) {
      cute::prefetch_tma_descriptor(&tma.q);
      load_head_tile_by_tma<Cfg::HT, Cfg::kDimTiles>(plan.q, plan.q_ready, &tma.q, cta);
    }
    if (producer_thread == 0 && params.prefetch_next_cta) prefetch_next_cta<Cfg>(params);
    // Producer threads 0 .. kFeeders - 1 feed WG0's ring, the rest WG1's.
    constexpr int kFeeders = Cfg::Ring::kFeeders;
    const int consumer = producer_thread / kFeeders;
    const bf16* keys = static_cast<const bf16*>(params.k) + int64_t(cta.batch) * params.s_kv * Cfg::D;
    gather_key_blocks<typename Cfg::Ring, Cfg::D>(plan.k[consumer], plan.ring, cta.slots, keys, consumer,
                                                  producer_thread % kFeeders);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume_blocks<Cfg>(plan, params, cta, warpgroup, thread_in_wg);
  }
#elif defined(__CUDA_ARCH__)
  // Built for an architecture without WGMMA/setmaxnreg: fail loudly rather
  // than return an output that was never written.
  __trap();
#endif
}

// ---------------------------------------------------------------------------
// Host launcher for one (D, HT) variant.
// ---------------------------------------------------------------------------
template <class Cfg>
LaunchStatus run_variant(const AttnDistParams& p, cudaStream_t stream, const char** detail) {
  // An empty problem must not launch: with T = 0 a CTA would exit while its Q
  // TMA is still in flight.
  if (p.batch < 1 || p.s_q < 1 || p.topk < 1 || p.h_q < 1 || p.s_kv < 0) {
    *detail = "empty or invalid problem (B, S, T and H must be >= 1): nothing to launch";
    return LaunchStatus::kInvalidProblem;
  }
  if (!Cfg::kTilesAlignGroups && Cfg::num_head_tiles(p.h_q) > 1) {
    *detail = "internal: a head tile that splits a 64-head group serves only H <= HT";
    return LaunchStatus::kInvalidProblem;
  }
  TmaParams tma{};
  if (LaunchStatus s = encode_head_tile_map(&tma.q, p.q, Cfg::D, p.h_q, p.s_q, p.batch, Cfg::HT, detail);
      s != LaunchStatus::kOk)
    return s;
  // The next CTA's prefetch (prefetch_next_cta), A/B on an H100
  // (docs/PERFORMANCE.md, "Design decisions"): -5 % at v32-h128 and h96, where K (9 MiB) and
  // every SM's prefetched Q fit in L2 together; +6 % at N = 128k, where the
  // prefetched Q takes L2 from the key rows' reuse; no change at HT = 64.
  // HT = 96 (a 108 KiB Q) has it on too; its A/B measured it so.
  AttnDistParams launch = p;
  const int64_t key_bytes = int64_t(p.batch) * p.s_kv * Cfg::D * int64_t(sizeof(bf16));
  const int64_t prefetched_q_bytes = int64_t(device_sm_count()) * Cfg::kQBytes;
  launch.prefetch_next_cta = Cfg::HT > 64 && key_bytes + prefetched_q_bytes <= device_l2_bytes();
  return launch_kernel(&attn_dist_kernel<Cfg>, int64_t(p.batch) * p.s_q * Cfg::num_head_tiles(p.h_q), kThreads,
                       Cfg::kSmemBytes,
                       stream, detail, launch, tma);
}

}  // namespace dist
}  // namespace attn_dist

// Explicit instantiation: CMake generates one file with this line per entry of the op's
// variants.py, and nvcc compiles those files up to four to a translation unit.
#define ATTN_DIST_INSTANTIATE(D, HT)                                                               \
  template attn_dist::LaunchStatus attn_dist::dist::run_variant<attn_dist::dist::Config<D, HT>>(   \
      const attn_dist::AttnDistParams&, cudaStream_t, const char**);
