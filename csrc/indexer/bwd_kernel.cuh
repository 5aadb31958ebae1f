// The SM90 indexer_kl backward kernel and its host launcher (the plan is in
// bwd_config.h).
//
// One CTA per query row (b, s); 2 warpgroups:
//   WG0  consumer. First the row's target mass tau (a fixed-order sum over its
//        valid slots). Then per block of 64 slots: z and the logits as in the
//        forward (kernel.cuh), dl = g (exp(logit - lse) tau - t), dz and the
//        three gradient GEMMs; the block's dK rows are staged in shared
//        memory and added to d_index_k by bulk reductions (float32 adds in
//        L2; deterministic mode: 64-bit fixed-point integer adds into the
//        workspace, exact in any order). At the end dQ and d weights are
//        written once.
//   WG1  producer: the forward's gather pipeline and index_q TMA load.
// d index_q and d weights have one writer and a fixed summation order: they
// are deterministic. d index_k's float32 reductions are not ordered; its
// integer ones need no order.
//
// The consumer's per-block steps (the row's target mass, the dK staging and
// the bulk reductions into d_index_k) are in bwd_steps.cuh.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/cta.cuh"
#include "bwd_config.h"
#include "fixed_point.cuh"
#include "bwd_steps.cuh"
#include "kernel.cuh"

namespace attn_dist {
namespace indexer {

using namespace cute;

// The producer loads slot indices one block ahead (the forward: two). A
// backward block is three GEMMs long, the ring holds several blocks, and two
// blocks of indices would not fit BwdConfig::kProducerRegs.
constexpr int kProducerLookahead = 1;
// Likewise the consumer's slot indices and targets: one block ahead is more
// than a memory round trip, and the registers are spoken for.
constexpr int kBwdSlotLookahead = 1;

template <class Cfg>
__device__ __forceinline__ void consume_blocks_bwd(typename Cfg::SharedMemoryPlan& plan, const IndexerBwdParams& p,
                                                   const CtaProblem& c, int thread_in_wg) {
  constexpr int HT = Cfg::HT;
  constexpr int DI = Cfg::DI;
  constexpr int kDimTiles = Cfg::kDimTiles;
  constexpr int consumer = 0;
  const int warp = thread_in_wg / 32;
  const int lane = thread_in_wg % 32;
  const int q = lane % 4;

  // z = K . Q^T, as in the forward.
  typename Cfg::TiledMma z_mma;
  auto z_thr = z_mma.get_slice(thread_in_wg);
  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(plan.k[consumer]), typename Cfg::Ring::SmemLayout{});
  Tensor tA = z_thr.partition_fragment_A(sK);
  Tensor tB = z_thr.partition_fragment_B(sQ);
  Tensor acc_z = partition_fragment_C(z_mma, Shape<Int<kBlockTopk>, Int<HT>>{});

  // dQ^T[dim tile] += K_stage^T . dz
  typename Cfg::DqMma dq_mma;
  dq_mma.accumulate_ = GMMA::ScaleOut::One;
  auto dq_thr = dq_mma.get_slice(thread_in_wg);
  Tensor sKmn = make_tensor(make_smem_ptr(plan.k[consumer]), typename Cfg::SmemLayoutKmn{});
  Tensor sDz = make_tensor(make_smem_ptr(plan.dz), typename Cfg::SmemLayoutDz{});
  Tensor tAk = dq_thr.partition_fragment_A(sKmn);
  Tensor tBdz = dq_thr.partition_fragment_B(sDz);
  using AccDq = decltype(partition_fragment_C(dq_mma, Shape<Int<kDimTile>, Int<HT>>{}));
  AccDq acc_dq[kDimTiles];
  CUTE_UNROLL
  for (int dt = 0; dt < kDimTiles; ++dt) {
    acc_dq[dt] = partition_fragment_C(dq_mma, Shape<Int<kDimTile>, Int<HT>>{});
    clear(acc_dq[dt]);
  }

  // dK = dz . Q, dz from registers (the WGMMA A layout of a 64 x HT tile is
  // the C layout of z: value 8kb + 4jj + 2rh + e is column 16kb + 8jj + 2q + e).
  typename Cfg::DkMma dk_mma;
  auto dk_thr = dk_mma.get_slice(thread_in_wg);
  Tensor sQmn = make_tensor(make_smem_ptr(plan.q), typename Cfg::SmemLayoutQmn{});
  Tensor tBq = dk_thr.partition_fragment_B(sQmn);
  Tensor tAdz = make_accumulator_a_fragment<typename Cfg::DkMma, HT>();
  Tensor acc_dk = partition_fragment_C(dk_mma, Shape<Int<kBlockTopk>, Int<DI>>{});
  static_assert(size(tAdz) == size(acc_z), "dz's A fragment holds z's values");

  const float g = p.g[c.row];
  const float lse = p.lse[c.row];
  // Deterministic mode's scale 2^F (row_bound_kernel ran before this
  // kernel), kept in shared memory: the HT = 64 consumer has no register to
  // spare across the loop. row_target_mass's barrier publishes it.
  if constexpr (Cfg::kDeterministic)
    if (thread_in_wg == 0) plan.to_fixed = fixed_point_scale(*p.bound_bits, p.scale_rows).to_fixed;
  const float tau = row_target_mass<Cfg>(plan, p, c, thread_in_wg);
  // A row with no target mass (or no valid slot) has all-zero gradients.
  const float g_live = tau > 0.f && lse > -INFINITY ? g : 0.f;

  // The thread's two rows of each block: slot block*64 + r0 + 8 rh.
  const int r0 = 16 * warp + lane / 4;
  const float* target_row = p.target + c.row * p.topk;
  int32_t ahead_index[kBwdSlotLookahead][2];
  float ahead_target[kBwdSlotLookahead][2];
  auto load_slots = [&](int block, int32_t (&index)[2], float (&target)[2]) {
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int t = block * kBlockTopk + r0 + 8 * rh;
      index[rh] = c.slots.load(t);  // -1 past T
      target[rh] = t < p.topk ? __ldg(target_row + t) : 0.f;
    }
  };
  CUTE_UNROLL
  for (int a = 0; a < kBwdSlotLookahead; ++a) load_slots(a, ahead_index[a], ahead_target[a]);

  float2 dw[HT / 8];
  CUTE_UNROLL
  for (int j = 0; j < HT / 8; ++j) dw[j] = make_float2(0.f, 0.f);

  auto* d_keys = [&] {
    if constexpr (Cfg::kDeterministic) return p.dk_fixed + int64_t(c.batch) * p.s_kv * DI;
    else return p.d_index_k + int64_t(c.batch) * p.s_kv * DI;
  }();
  const bool reducer = lane < 16;  // lane l of warp w reduces the block's row 16w + l
  RingPos<Cfg::kStages> pos;
  const int num_blocks = c.slots.num_blocks();
  cutlass::arch::ClusterTransactionBarrier::wait(&plan.q_ready, 0);
  for (int block = 0; block < num_blocks; ++block) {
    int32_t key[2];
    float t[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      key[rh] = c.slots.key_if_valid(ahead_index[0][rh]);
      t[rh] = key[rh] >= 0 && ahead_target[0][rh] > 0.f ? ahead_target[0][rh] : 0.f;
    }
    CUTE_UNROLL
    for (int a = 0; a + 1 < kBwdSlotLookahead; ++a)
      CUTE_UNROLL
      for (int rh = 0; rh < 2; ++rh) ahead_index[a][rh] = ahead_index[a + 1][rh], ahead_target[a][rh] = ahead_target[a + 1][rh];
    load_slots(block + kBwdSlotLookahead, ahead_index[kBwdSlotLookahead - 1], ahead_target[kBwdSlotLookahead - 1]);

    int stage[kDimTiles];
    acquire_block<Cfg>(plan, consumer, pos, stage);
    // The weights come from shared memory each block: 16 registers fewer
    // than the forward's loop-invariant copy, which the accumulators need.
    TileWeights<Cfg> weights;
    weights.load(plan.weights, lane);
    float partial[2];
    block_logits<Cfg>(plan, z_mma, tA, tB, acc_z, c, stage, lane, weights, partial);
    quad_sum(partial);

    // dl, then dz = dl * scale * w * [z > 0] and d w += dl * relu(z).
    float dl[2], dl_scaled[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      dl[rh] = key[rh] >= 0 ? g_live * (exp_approx(p.scale * partial[rh] - lse) * tau - t[rh]) : 0.f;
      dl_scaled[rh] = dl[rh] * p.scale;
    }
    // A non-finite dl (index_k or lse not finite; the other operands are in
    // the row bound) would become a zero integer: flag it, d_index_k is NaN.
    if constexpr (Cfg::kDeterministic)
      if (!(fabsf(dl_scaled[0]) <= FLT_MAX && fabsf(dl_scaled[1]) <= FLT_MAX)) flag_non_finite(p.flag_bits);
    CUTE_UNROLL
    for (int j = 0; j < HT / 8; ++j) {
      const float2 w = weights.w[j];
      CUTE_UNROLL
      for (int rh = 0; rh < 2; ++rh) {
        const float z0 = acc_z(4 * j + 2 * rh), z1 = acc_z(4 * j + 2 * rh + 1);
        dw[j].x = fmaf(dl[rh], fmaxf(z0, 0.f), dw[j].x);
        dw[j].y = fmaf(dl[rh], fmaxf(z1, 0.f), dw[j].y);
        const bf16 dz0 = bf16(z0 > 0.f ? dl_scaled[rh] * w.x : 0.f);
        const bf16 dz1 = bf16(z1 > 0.f ? dl_scaled[rh] * w.y : 0.f);
        tAdz(4 * j + 2 * rh) = dz0;
        tAdz(4 * j + 2 * rh + 1) = dz1;
        // dz[key r0 + 8 rh, heads 8j + 2q, +1] for dQ's GEMM: adjacent in the MN-major tile.
        __nv_bfloat162 pair;
        pair.x = dz0.to_nv_bfloat16();
        pair.y = dz1.to_nv_bfloat16();
        *reinterpret_cast<__nv_bfloat162*>(&sDz(8 * j + 2 * q, r0 + 8 * rh)) = pair;
      }
    }
    cutlass::arch::fence_view_async_shared();  // dz's generic-proxy stores, before WGMMA reads them
    // The previous block's reductions have read the dK staging rows, which
    // this block rewrites after the sync. (Deterministic mode: each warp
    // waits for its own rows' buffer before staging each chunk.)
    if constexpr (!Cfg::kDeterministic)
      if (reducer) wait_reductions_read();
    consumer_sync();

    CUTE_UNROLL
    for (int dt = 0; dt < kDimTiles; ++dt) warpgroup_fence_operand(acc_dq[dt]);
    warpgroup_fence_operand(acc_dk);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int dt = 0; dt < kDimTiles; ++dt)
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tAk); ++kb) cute::gemm(dq_mma, tAk(_, _, kb, stage[dt]), tBdz(_, _, kb), acc_dq[dt]);
    dk_mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tAdz); ++kb) {
      cute::gemm(dk_mma, tAdz(_, _, kb), tBq(_, _, kb), acc_dk);
      dk_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    CUTE_UNROLL
    for (int dt = 0; dt < kDimTiles; ++dt) warpgroup_fence_operand(acc_dq[dt]);
    warpgroup_fence_operand(acc_dk);
    release_block<Cfg>(plan, consumer, stage, lane);
    // The block's rows' keys for the reducers (the quad's lane 0 knows them);
    // the last block's reducers read theirs before this block's first barrier.
    if (q == 0) plan.row_key[r0] = key[0], plan.row_key[r0 + 8] = key[1];
    if constexpr (!Cfg::kDeterministic) {
      stage_dk_rows<Cfg>(plan, acc_dk, r0, q);
      cutlass::arch::fence_view_async_shared();  // the staging stores, before the copy engine reads them
      // All warps are past their WGMMA waits here, so the next block's dz
      // stores cannot overtake this block's reads of sDz either.
      consumer_sync();
      if (reducer) {
        const int r = 16 * warp + lane;
        const int32_t row_key = plan.row_key[r];
        if (row_key >= 0) reduce_row_async(d_keys + int64_t(row_key) * DI, plan.dk[r], DI * int(sizeof(float)));
        commit_reductions();
      }
    } else {
      // All warps are past their WGMMA waits: the next block's dz stores
      // cannot overtake this block's reads of sDz. From here on each warp
      // stages and reduces its own rows 16 warp .. 16 warp + 15.
      consumer_sync();
      CUTE_UNROLL
      for (int chunk = 0; chunk < Cfg::kFixedChunks; ++chunk) {
        // The buffer's previous chunk (this block's or the last block's, two
        // chunks back) has been read; the newest group may still be pending.
        if (reducer) wait_reductions_read<Cfg::kFixedBuffers - 1>();
        __syncwarp();
        stage_dk_fixed_chunk<Cfg>(plan, acc_dk, chunk, r0, q);
        cutlass::arch::fence_view_async_shared();
        __syncwarp();
        if (reducer) {
          const int r = 16 * warp + lane;
          const int32_t row_key = plan.row_key[r];
          if (row_key >= 0)
            reduce_row_async(d_keys + int64_t(row_key) * DI + chunk * Cfg::kFixedChunkDims,
                             plan.dk[chunk % Cfg::kFixedBuffers][r], Cfg::kFixedChunkDims * int(sizeof(long long)));
          commit_reductions();
        }
      }
    }
  }
  if (reducer) wait_reductions();  // the staging rows live in this CTA's shared memory

  // d weights: the quad's column sums over the warp's rows (fixed butterfly),
  // then the 4 warps in order.
  CUTE_UNROLL
  for (int j = 0; j < HT / 8; ++j)
    CUTE_UNROLL
    for (int mask = 4; mask < 32; mask <<= 1) {
      dw[j].x += __shfl_xor_sync(0xffffffffu, dw[j].x, mask);
      dw[j].y += __shfl_xor_sync(0xffffffffu, dw[j].y, mask);
    }
  if (lane < 4)
    CUTE_UNROLL
    for (int j = 0; j < HT / 8; ++j) {
      plan.dw[warp][8 * j + 2 * q] = dw[j].x;
      plan.dw[warp][8 * j + 2 * q + 1] = dw[j].y;
    }
  consumer_sync();
  if (thread_in_wg < p.h_idx) {
    float sum = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < kConsumerWarps; ++w) sum += plan.dw[w][thread_in_wg];
    p.d_weights[c.row * p.h_idx + thread_in_wg] = sum * p.scale;
  }

  // d index_q[row, h, d] from dQ^T[d, h]: value 4j + 2rh + e of dim tile dt is
  // dim 64 dt + r0 + 8 rh, head 8j + 2q + e.
  bf16* d_q = static_cast<bf16*>(p.d_index_q) + c.row * p.h_idx * DI;
  CUTE_UNROLL
  for (int dt = 0; dt < kDimTiles; ++dt)
    CUTE_UNROLL
    for (int j = 0; j < HT / 8; ++j)
      CUTE_UNROLL
      for (int rh = 0; rh < 2; ++rh)
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
          const int h = 8 * j + 2 * q + e;
          if (h < p.h_idx) d_q[h * DI + dt * kDimTile + r0 + 8 * rh] = bf16(acc_dq[dt](4 * j + 2 * rh + e));
        }
}

template <class Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kCtasPerSm)
    indexer_bwd_kernel(const __grid_constant__ IndexerBwdParams params, const __grid_constant__ TmaParams tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int thread_in_wg = threadIdx.x % kWarpgroupThreads;
  const CtaProblem cta = locate_cta<Cfg>(params);
  auto& plan = init_plan<Cfg>(smem_raw);

  if (warpgroup == kNumConsumers) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    produce_row<Cfg, kProducerLookahead>(plan, params, tma, cta, thread_in_wg);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    load_row_weights<Cfg>(plan, params, cta);
    consume_blocks_bwd<Cfg>(plan, params, cta, thread_in_wg);
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

template <class Cfg>
LaunchStatus run_bwd_variant(const IndexerBwdParams& p, cudaStream_t stream, const char** detail) {
  if constexpr (!Cfg::kDeterministic) {
    return launch_per_row<Cfg>(&indexer_bwd_kernel<Cfg>, p, stream, detail);
  } else {
    // The rows' bounds (and so F), the fixed-point sums, then d_index_k
    // (sums_only: the sums alone, the bound given).
    if (!p.sums_only)
      if (LaunchStatus s = launch_row_bounds(p, stream, detail); s != LaunchStatus::kOk) return s;
    if (LaunchStatus s = launch_per_row<Cfg>(&indexer_bwd_kernel<Cfg>, p, stream, detail); s != LaunchStatus::kOk)
      return s;
    return p.sums_only ? LaunchStatus::kOk : launch_fixed_to_float(p, stream, detail);
  }
}

}  // namespace indexer
}  // namespace attn_dist

// Explicit instantiation: CMake generates one file per variants.py entry (up to four per unit).
#define INDEXER_BWD_INSTANTIATE(DI, HT, DETERMINISTIC)                                             \
  template attn_dist::LaunchStatus                                                                   \
  attn_dist::indexer::run_bwd_variant<attn_dist::indexer::BwdConfig<DI, HT, DETERMINISTIC>>(         \
      const attn_dist::IndexerBwdParams&, cudaStream_t, const char**);
