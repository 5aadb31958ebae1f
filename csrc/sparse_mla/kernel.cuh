// The SM90 sparse MLA forward kernel and its host launcher (the warp roles
// and the shared-memory plan: config.h; the consumers' steps: steps.cuh).
//
// Per block pair (even block in buffer 0, odd block in buffer 1):
//   WG0: S0 = Q.K0^T; m0 = max(r, row max of S0); publish m0.
//   WG1: S1 = Q.K1^T; m1 = max(m0, row max of S1); publish the reference r'
//        (r, or m1 where m1 passes r by more than kRescaleThreshold).
//   Both: rescale O and the row sums from r to r' (where it moved); P =
//        exp2(S - r') as bf16: its own block's P . V from registers, and P
//        into the block's shared P tile for the other;
//   WG0: O[:, 0:256] += P0 . V0 + P1 . V1;  WG1: O[:, 256:512] += P1 . V1 + P0 . V0.
// Both end with the same reference; their row sums add up to the softmax
// denominator, and each stores its half of the output.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/cta.cuh"
#include "../common/gather.cuh"
#include "../common/host.h"
#include "../common/slot_validity.cuh"
#include "../common/timeline.cuh"
#include "config.h"
#include "row.cuh"
#include "steps.cuh"

namespace attn_dist {
namespace sparse_mla {

using namespace cute;

// Timeline events of a consumer's pair, and of the producer's (a timeline
// build only, common/timeline.cuh; tools/timeline.py reads these names).
enum ConsumerMark : int {
  kMarkTop,              // the pair's loop top
  kMarkLanded,           // the first key tile its scores read has landed
  kMarkLandedHalf,       // ... and the fifth
  kMarkScoresDone,       // its block's scores completed
  kMarkMaxExchanged,     // WG0: its max published; WG1: WG0's received
  kMarkReference,        // WG0: the pair's reference received; WG1: published
  kMarkOwnPvIssued,      // the P.V of its own block issued (P from registers; after its last k-step)
  kMarkPPublished,       // its P stored in its tile and published
  kMarkOtherPReady,      // the other consumer's P ready
  kMarkOtherLanded,      // the other block's value half landed
  kMarkOtherPvIssued,    // the other block's P.V issued
  kMarkFirstPvDone,      // its own block's P.V completed (before the other P is waited for)
  kMarkPvDone,           // both completed
};
enum ProducerMark : int {  // the pair's halves in fill order: its first stage freed, its copies issued
  kMarkHalf0Freed, kMarkHalf0Issued,  // buffer 0, tiles 0..3
  kMarkHalf1Freed, kMarkHalf1Issued,  // buffer 1, tiles 4..
  kMarkHalf2Freed, kMarkHalf2Issued,  // buffer 0, tiles 4..
  kMarkHalf3Freed, kMarkHalf3Issued,  // buffer 1, tiles 0..3
  kMarkProducerTop,                   // the pair's loop top
};

// WG0: the even blocks' scores, output dims 0..255.
template <class Cfg>
__device__ __forceinline__ void consume_even(typename Cfg::SharedMemoryPlan& plan, const SparseMlaFwdParams& p,
                                             const CtaProblem& c, ConsumerState<Cfg>& st, int thread) {
  constexpr int kValueTiles = kDv / kDimTile;
  const int warp = thread / 32, lane = thread % 32;
  const int row0 = 16 * warp + lane / 4;
  Tensor accS = partition_fragment_C(typename Cfg::MmaQK{}, Shape<Int<Cfg::HT>, Int<kBlockTopk>>{});
  const int num_blocks = c.slots.num_blocks();
  CUTE_NO_UNROLL
  for (int block = 0; block < num_blocks; block += 2) {
    const uint32_t phase = (block / 2) & 1;
    const bool has_odd = block + 1 < num_blocks;
    const int pair = block / 2;
    auto mark = [&](int event) { timeline::mark(thread == 0, 0, pair, event); };
    mark(kMarkTop);
    const BlockSlots slots = load_block_slots(c.slots, block, lane);
    issue_scores<Cfg>(plan, 0, phase, block == 0, accS, thread, [&](int i) {
      if (i == 0 || i == kVTilesPerConsumer) mark(i == 0 ? kMarkLanded : kMarkLandedHalf);
    });
    warpgroup_wait<0>();
    mark(kMarkScoresDone);
    release<Cfg>(plan, 0, kVTilesPerConsumer, kValueTiles - kVTilesPerConsumer, lane);  // WG1's value tiles

    float even_max[2];
    mask_row_max(accS, valid_slot_mask(c.slots, slots), p.scale_log2, even_max, lane);
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      even_max[rh] = fmaxf(st.reference[rh], even_max[rh]);
      if (lane % 4 == 0) plan.max_of_even[phase][row0 + 8 * rh] = even_max[rh];
    }
    mark(kMarkMaxExchanged);
    NamedBarrier::arrive(kPairThreads, kMaxOfEvenReady);
    NamedBarrier::sync(kPairThreads, kReferenceReady);
    mark(kMarkReference);
    float reference[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) reference[rh] = plan.reference_of_pair[phase][row0 + 8 * rh];
    rescale_to(st, reference);
    own_block_pv<Cfg>(plan, st, accS, reference, p.scale_log2, 0, kEvenPReady, thread,
                      [&] { mark(kMarkOwnPvIssued); }, [&] { mark(kMarkPPublished); });
    // P0 . V0 done: its stages go back to the gather of the next even block
    // before this warpgroup waits for WG1's P.
    warpgroup_wait<0>();
    mark(kMarkFirstPvDone);
    release_after_pv<Cfg>(plan, 0, 0, lane);
    if (has_odd) {
      NamedBarrier::sync(kPairThreads, kOddPReady);
      mark(kMarkOtherPReady);
      wait_landed<Cfg>(plan, 1, 0, kVTilesPerConsumer, phase);
      mark(kMarkOtherLanded);
      issue_pv<Cfg>(plan, 1, 0, st.accO, thread);
      mark(kMarkOtherPvIssued);
      warpgroup_wait<0>();
      mark(kMarkPvDone);
      release_after_pv<Cfg>(plan, 1, 0, lane);
    } else {
      mark(kMarkPvDone);
    }
  }
}

// WG1: the odd blocks' scores, output dims 256..511.
template <class Cfg>
__device__ __forceinline__ void consume_odd(typename Cfg::SharedMemoryPlan& plan, const SparseMlaFwdParams& p,
                                            const CtaProblem& c, ConsumerState<Cfg>& st, int thread) {
  const int warp = thread / 32, lane = thread % 32;
  const int row0 = 16 * warp + lane / 4;
  Tensor accS = partition_fragment_C(typename Cfg::MmaQK{}, Shape<Int<Cfg::HT>, Int<kBlockTopk>>{});
  const int num_blocks = c.slots.num_blocks();
  CUTE_NO_UNROLL
  for (int block = 0; block < num_blocks; block += 2) {
    const uint32_t phase = (block / 2) & 1;
    const bool has_odd = block + 1 < num_blocks;
    const int pair = block / 2;
    auto mark = [&](int event) { timeline::mark(thread == 0, 1, pair, event); };
    mark(kMarkTop);
    float odd_max[2] = {-INFINITY, -INFINITY};
    if (has_odd) {
      const BlockSlots slots = load_block_slots(c.slots, block + 1, lane);
      issue_scores<Cfg, Cfg::kOddFirstTile>(plan, 1, phase, block == 0, accS, thread, [&](int i) {
        if (i == 0 || i == Cfg::kDimTiles - kVTilesPerConsumer) mark(i == 0 ? kMarkLanded : kMarkLandedHalf);
      });
      warpgroup_wait<0>();
      mark(kMarkScoresDone);
      release<Cfg>(plan, 1, 0, kVTilesPerConsumer, lane);  // WG0's value tiles
      if constexpr (Cfg::kHasRopeTile) release<Cfg>(plan, 1, Cfg::kDimTiles - 1, 1, lane);  // S1 alone reads it
      mask_row_max(accS, valid_slot_mask(c.slots, slots), p.scale_log2, odd_max, lane);
    }
    NamedBarrier::sync(kPairThreads, kMaxOfEvenReady);
    mark(kMarkMaxExchanged);
    float reference[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      reference[rh] = next_reference(st.reference[rh], fmaxf(plan.max_of_even[phase][row0 + 8 * rh], odd_max[rh]));
      if (lane % 4 == 0) plan.reference_of_pair[phase][row0 + 8 * rh] = reference[rh];
    }
    NamedBarrier::arrive(kPairThreads, kReferenceReady);
    mark(kMarkReference);
    rescale_to(st, reference);
    if (has_odd) {
      own_block_pv<Cfg>(plan, st, accS, reference, p.scale_log2, 1, kOddPReady, thread,
                        [&] { mark(kMarkOwnPvIssued); }, [&] { mark(kMarkPPublished); });
      // P1 . V1 done: its stages go back to the gather of the next odd block
      // before this warpgroup waits for WG0's P.
      warpgroup_wait<0>();
      mark(kMarkFirstPvDone);
      release_after_pv<Cfg>(plan, 1, kVTilesPerConsumer, lane);
    }
    NamedBarrier::sync(kPairThreads, kEvenPReady);
    mark(kMarkOtherPReady);
    wait_landed<Cfg>(plan, 0, kVTilesPerConsumer, kVTilesPerConsumer, phase);
    mark(kMarkOtherLanded);
    issue_pv<Cfg>(plan, 0, 1, st.accO, thread);
    mark(kMarkOtherPvIssued);
    warpgroup_wait<0>();
    mark(kMarkPvDone);
    release_after_pv<Cfg>(plan, 0, kVTilesPerConsumer, lane);
  }
}

// Both consumers: the softmax denominator from both row-sum shares, lse
// (WG0), and this half of out = O / l through a tile staged in the key
// buffers (every gather has landed and been read),
// stored with coalesced 16-byte writes. Rows with no valid slot: out = 0, lse = -inf.
template <class Cfg>
__device__ __forceinline__ void finish(typename Cfg::SharedMemoryPlan& plan, const SparseMlaFwdParams& p,
                                       const CtaProblem& c, ConsumerState<Cfg>& st, int consumer, int thread) {
  const int warp = thread / 32, lane = thread % 32;
  const int row0 = 16 * warp + lane / 4;
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    st.row_sum[rh] += __shfl_xor_sync(0xffffffffu, st.row_sum[rh], 1);
    st.row_sum[rh] += __shfl_xor_sync(0xffffffffu, st.row_sum[rh], 2);
    if (lane % 4 == 0) plan.row_sum[consumer][row0 + 8 * rh] = st.row_sum[rh];
  }
  // After this barrier no WGMMA reads the key buffers (each consumer waited for its last).
  NamedBarrier::sync(kPairThreads, kRowSumsReady);
  const int head0 = c.head_tile * Cfg::HT;
  const int64_t token = int64_t(c.batch) * p.s_q + c.s;
  float inv_sum[2];
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const int row = row0 + 8 * rh;
    const float sum = plan.row_sum[0][row] + plan.row_sum[1][row];  // the same order in both
    inv_sum[rh] = sum > 0.f ? 1.f / sum : 0.f;
    if (consumer == 0 && lane % 4 == 0 && head0 + row < p.h_q) {
      float lse = sum > 0.f ? st.reference[rh] + __log2f(sum) : -INFINITY;
      if (p.lse_base_e) lse *= 0.6931471805599453f;  // ln(2)
      p.lse[token * p.h_q + head0 + row] = lse;
    }
  }
  bf16* staged = &plan.kv[0][0];
  CUTE_UNROLL
  for (int j = 0; j < kDvPerConsumer / 8; ++j)
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int i = 4 * j + 2 * rh;
      const int col = consumer * kDvPerConsumer + 8 * j + 2 * (lane % 4);
      *reinterpret_cast<__nv_bfloat162*>(staged + (row0 + 8 * rh) * Cfg::kStagedRowElems + col) =
          __floats2bfloat162_rn(st.accO(i) * inv_sum[rh], st.accO(i + 1) * inv_sum[rh]);
    }
  NamedBarrier::sync(kPairThreads, kOutputStaged);
  constexpr int kChunksPerRow = kDv / 8;  // 16 bytes each
  const int rows = min(Cfg::HT, p.h_q - head0);
  bf16* out = static_cast<bf16*>(p.out) + (token * p.h_q + head0) * int64_t(kDv);
  const int pair_thread = consumer * kWarpgroupThreads + thread;
  for (int chunk = pair_thread; chunk < rows * kChunksPerRow; chunk += int(kPairThreads)) {
    const int row = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
    *reinterpret_cast<uint4*>(out + row * kDv + col) =
        *reinterpret_cast<const uint4*>(staged + row * Cfg::kStagedRowElems + col);
  }
}

// ---------------------------------------------------------------------------
// Producer (WG2, all 128 threads): each pair's two key blocks, half a block at
// a time in the order the consumers free and need them: buffer 0's value
// tiles 0..3 (WG0's first P.V frees them), buffer 1's tiles 4.. (WG1's), then
// buffer 0's 4.. and buffer 1's 0..3 (the second products'). The rows, their
// validity and the copies are the shared gather's (common/gather.cuh).
// ---------------------------------------------------------------------------
template <class Cfg>
__device__ __forceinline__ void gather_block_pairs(typename Cfg::SharedMemoryPlan& plan, const RowSlots& slots,
                                                   const bf16* keys, int feeder) {
  using Ring = typename Cfg::Ring;
  using Feeder = KeyRowFeeder<Ring, Cfg::D>;
  static_assert(Ring::kFeeders == kWarpgroupThreads, "every producer thread feeds both buffers");
  const Feeder f(slots, keys, feeder);
  const int num_blocks = slots.num_blocks();
  int pair = 0;
  // The pair's k-th half (in fill order): dim tiles first .. end - 1 of `buffer`.
  auto copy_tiles = [&](int k, int buffer, const typename Feeder::BlockRows& rows, int first, int end,
                        uint32_t free_parity) {
    for (int dt = first; dt < end; ++dt) {
      f.fill_stage(plan.kv[buffer] + dt * Ring::kStageElems, &plan.ring.empty[buffer][dt], &plan.ring.full[buffer][dt],
                   free_parity, rows, dt);
      if (dt == first) timeline::mark(feeder == 0, 2, pair, kMarkHalf0Freed + 2 * k);
    }
    timeline::mark(feeder == 0, 2, pair, kMarkHalf0Issued + 2 * k);
  };

  int32_t ahead[2][Feeder::kRows];  // the next pair's slot indices, loaded a pair ahead
  f.load_indices(0, ahead[0]);
  f.load_indices(1, ahead[1]);
  for (int block = 0; block < num_blocks; block += 2) {
    const uint32_t free_parity = ((block / 2) & 1) ^ 1;
    const bool has_odd = block + 1 < num_blocks;
    pair = block / 2;
    timeline::mark(feeder == 0, 2, pair, kMarkProducerTop);
    const typename Feeder::BlockRows even = f.block_rows(ahead[0]), odd = f.block_rows(ahead[1]);
    if (block + 2 < num_blocks) {
      f.load_indices(block + 2, ahead[0]);
      f.load_indices(block + 3, ahead[1]);
    }
    copy_tiles(0, 0, even, 0, kVTilesPerConsumer, free_parity);
    if (has_odd) copy_tiles(1, 1, odd, kVTilesPerConsumer, Cfg::kDimTiles, free_parity);
    copy_tiles(2, 0, even, kVTilesPerConsumer, Cfg::kDimTiles, free_parity);
    if (has_odd) copy_tiles(3, 1, odd, 0, kVTilesPerConsumer, free_parity);
  }
  cute::cp_async_wait<0>();
}

// ---------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------
template <class Cfg>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    sparse_mla_fwd_kernel(const __grid_constant__ SparseMlaFwdParams params, const __grid_constant__ TmaParams tma) {
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
    Cfg::Ring::init(plan.ring, [](int buffer, int stage) { return Cfg::stage_readers(buffer, stage); });
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == kNumConsumers) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    // A row with no live block needs no Q: a CTA must not exit with its TMA in flight.
    if (thread_in_wg == 0 && cta.slots.num_blocks() > 0) {
      cute::prefetch_tma_descriptor(&tma.q);
      load_head_tile_by_tma<Cfg::HT, Cfg::kDimTiles>(plan.q, plan.q_ready, &tma.q, cta);
    }
    const bf16* keys = static_cast<const bf16*>(params.kv) + int64_t(cta.batch) * params.s_kv * Cfg::D;
    gather_block_pairs<Cfg>(plan, cta.slots, keys, thread_in_wg);
    timeline::mark_end(thread_in_wg == 0, kNumConsumers);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    ConsumerState<Cfg> st;
    clear(st.accO);
    if (warpgroup == 0) consume_even<Cfg>(plan, params, cta, st, thread_in_wg);
    else consume_odd<Cfg>(plan, params, cta, st, thread_in_wg);
    finish<Cfg>(plan, params, cta, st, warpgroup, thread_in_wg);
    timeline::mark_end(thread_in_wg == 0, warpgroup);
  }
#elif defined(__CUDA_ARCH__)
  // Built for an architecture without WGMMA/setmaxnreg: fail loudly rather
  // than return an output that was never written.
  __trap();
#endif
}

// ---------------------------------------------------------------------------
// Host launcher for one D variant.
// ---------------------------------------------------------------------------
template <class Cfg>
LaunchStatus run_fwd_variant(const SparseMlaFwdParams& p, cudaStream_t stream, const char** detail) {
  // T = 0 launches: every row then has no valid slot (out = 0, lse = -inf).
  if (p.batch < 1 || p.s_q < 1 || p.topk < 0 || p.h_q < 1 || p.s_kv < 0) {
    *detail = "empty or invalid problem (B, S and H must be >= 1): nothing to launch";
    return LaunchStatus::kInvalidProblem;
  }
  if (p.d_v != kDv) {
    *detail = "the kernel computes d_v = 512 value dims";
    return LaunchStatus::kInvalidProblem;
  }
  TmaParams tma{};
  if (LaunchStatus s = encode_head_tile_map(&tma.q, p.q, Cfg::D, p.h_q, p.s_q, p.batch, Cfg::HT, detail);
      s != LaunchStatus::kOk)
    return s;
  const timeline::Recorder timeline(stream);
  const LaunchStatus status = launch_kernel(&sparse_mla_fwd_kernel<Cfg>,
                                            int64_t(p.batch) * p.s_q * Cfg::num_head_tiles(p.h_q), kThreads,
                                            Cfg::kSmemBytes, stream, detail, p, tma);
  timeline.write(stream);
  return status;
}

}  // namespace sparse_mla
}  // namespace attn_dist

// Explicit instantiation: CMake generates one file with this line per entry of the op's
// variants.py, and nvcc compiles those files up to four to a translation unit.
#define SPARSE_MLA_FWD_INSTANTIATE(D, HT)                                                               \
  template attn_dist::LaunchStatus                                                                    \
  attn_dist::sparse_mla::run_fwd_variant<attn_dist::sparse_mla::FwdConfig<D, HT>>(                    \
      const attn_dist::SparseMlaFwdParams&, cudaStream_t, const char**);
