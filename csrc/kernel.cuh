// The SM90 attn_dist kernel and its host launcher.
//
// One CTA per (batch, query token, head tile of HT heads); 3 warpgroups:
//   WG0, WG1  consumers. Both hold the whole head tile; WG0 takes the even key
//             blocks of 64 top-k slots, WG1 the odd ones. Per block: 64xHTxD
//             WGMMA over the D/64 dim tiles, then p = exp2(acc*scale - lse),
//             the per-group head sum (a row sum), and a store of 64 floats per group.
//   WG2       producer. Its first two warps gather the K rows of WG0's blocks,
//             the last two those of WG1's, 128 bytes per row per dim tile, with
//             cp.async (16 B, zero-filled for invalid slots: no read at all)
//             into that consumer's ring of stages. One thread loads Q by TMA.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cuda_host_adapter.hpp>

#include "config.h"
#include "params.h"

namespace attn_dist {

using namespace cute;

// ---------------------------------------------------------------------------
// Per-CTA facts shared by producer and consumers.
// ---------------------------------------------------------------------------
struct CtaProblem {
  int batch, s, head_tile;
  int num_blocks;            // ceil(T / 64)
  int64_t max_visible_key;   // causal bound on the key index (INT64_MAX if not causal)
  const int32_t* indices;    // this token's T slots
};

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

template <class Cfg>
__device__ __forceinline__ CtaProblem locate_cta(const AttnDistParams& p) {
  const int num_head_tiles = (p.h_q + Cfg::HT - 1) / Cfg::HT;
  int linear = blockIdx.x;
  CtaProblem c;
  c.head_tile = linear % num_head_tiles;
  linear /= num_head_tiles;
  c.s = linear % p.s_q;
  c.batch = linear / p.s_q;
  c.num_blocks = (p.topk + kBlockTopk - 1) / kBlockTopk;
  if (p.causal) {
    // Query at absolute position q_start + s sees key i iff
    // i <= floor((q_start + s + 1 - k_stride) / k_stride). 64-bit: no overflow.
    const int64_t pos = int64_t(p.q_start[c.batch]) + c.s;
    c.max_visible_key = floor_div(pos + 1 - p.k_stride, p.k_stride);
  } else {
    c.max_visible_key = INT64_MAX;
  }
  c.indices = p.indices + (int64_t(c.batch) * p.s_q + c.s) * p.topk;
  return c;
}

// The raw index of slot t (any int32), or -1 past T.
__device__ __forceinline__ int32_t load_slot_index(const CtaProblem& c, int t, int topk) {
  return t < topk ? __ldg(c.indices + t) : -1;
}

// The key of a slot index if it is valid (in [0, N) and causally visible), else -1.
__device__ __forceinline__ int32_t key_if_valid(const CtaProblem& c, int32_t i, int s_kv) {
  const bool ok = i >= 0 && i < s_kv && int64_t(i) <= c.max_visible_key;
  return ok ? i : -1;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Ring position of a consumer's n-th stage use.
template <class Cfg>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == Cfg::kStages) { stage = 0; phase ^= 1; }
  }
};

// ---------------------------------------------------------------------------
// Producer steps (WG2).
// ---------------------------------------------------------------------------
template <class Cfg>
__device__ __forceinline__ void load_q_by_tma(typename Cfg::SharedMemoryPlan& plan, const TmaParams& tma,
                                              const CtaProblem& c) {
  constexpr uint32_t kTileBytes = Cfg::HT * kDimTile * sizeof(bf16);
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt) {
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&plan.q_ready[dt], kTileBytes);
    // Rows past H are zero-filled by TMA; Q is read once, so evict it first.
    SM90_TMA_LOAD_4D::copy(&tma.q, &plan.q_ready[dt], uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                           plan.q + dt * Cfg::HT * kDimTile, dt * kDimTile, c.head_tile * Cfg::HT, c.s,
                           c.batch);
  }
}

// 64 producer threads feed one consumer's ring. Thread `feeder` copies 16-byte
// chunk (feeder % 8) of rows (feeder / 8) + 8 * r, r = 0..7, of each stage.
template <class Cfg>
__device__ __forceinline__ void gather_k_blocks(typename Cfg::SharedMemoryPlan& plan, const AttnDistParams& p,
                                                const CtaProblem& c, int consumer, int feeder) {
  constexpr int kRowsPerThread = kBlockTopk / 8;
  const int chunk = feeder % 8;
  const int row0 = feeder / 8;  // == row % 8 for all of this thread's rows
  const bf16* k_batch = static_cast<const bf16*>(p.k) + int64_t(c.batch) * p.s_kv * Cfg::D;
  // The 128-byte swizzle (Swizzle<3,4,3>) XORs the 16-byte chunk with row % 8.
  const int smem_chunk_elems = (chunk ^ row0) * 8;
  RingPos<Cfg> pos;

  // The slot indices are loaded one block ahead: waiting for them at the start
  // of each block stalled the gather for an L2 round trip per block.
  int32_t next_index[kRowsPerThread];
  auto load_block_indices = [&](int block) {
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r)
      next_index[r] = load_slot_index(c, block * kBlockTopk + row0 + 8 * r, p.topk);
  };
  if (consumer < c.num_blocks) load_block_indices(consumer);
  for (int block = consumer; block < c.num_blocks; block += kNumConsumers) {
    int32_t key[kRowsPerThread];  // -1: zero-fill, read nothing
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) key[r] = key_if_valid(c, next_index[r], p.s_kv);
    if (block + kNumConsumers < c.num_blocks) load_block_indices(block + kNumConsumers);
    for (int dt = 0; dt < Cfg::kDimTiles; ++dt) {
      cutlass::arch::ClusterBarrier::wait(&plan.k_empty[consumer][pos.stage], pos.phase ^ 1);
      bf16* stage = plan.k[consumer] + pos.stage * (kBlockTopk * kDimTile);
      const bf16* k_tile = k_batch + dt * kDimTile + chunk * 8;
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) {
        // 64-bit row offset: key * D passes 2^31 for N > 3.7M at D = 576.
        const bf16* src = k_tile + int64_t(key[r] >= 0 ? key[r] : 0) * Cfg::D;
        bf16* dst = stage + (row0 + 8 * r) * kDimTile + smem_chunk_elems;
        SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(src),
                                                         *reinterpret_cast<uint128_t*>(dst), key[r] >= 0);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(&plan.k_full[consumer][pos.stage]);
      pos.advance();
    }
  }
  cp_async_wait<0>();
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
                                              bool first_block, RingPos<Cfg>& pos, int lane) {
  int prev_stage = -1;
  CUTE_NO_UNROLL
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt) {
    if (first_block) cutlass::arch::ClusterTransactionBarrier::wait(&plan.q_ready[dt], 0);
    cutlass::arch::ClusterBarrier::wait(&plan.k_full[consumer][pos.stage], pos.phase);
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
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&plan.k_empty[consumer][prev_stage]);
    }
    prev_stage = pos.stage;
    pos.advance();
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&plan.k_empty[consumer][prev_stage]);
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

template <class Cfg>
__device__ __forceinline__ void consume_blocks(typename Cfg::SharedMemoryPlan& plan, const AttnDistParams& p,
                                               const CtaProblem& c, int consumer, int thread_in_wg) {
  const int warp = thread_in_wg / 32;
  const int lane = thread_in_wg % 32;
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_slice(thread_in_wg);
  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Cfg::SmemLayoutQ{});            // (HT, 64, D/64)
  Tensor sK = make_tensor(make_smem_ptr(plan.k[consumer]), typename Cfg::SmemLayoutK{});  // (64, 64, stages)
  Tensor tA = thr_mma.partition_fragment_A(sK);
  Tensor tB = thr_mma.partition_fragment_B(sQ);
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockTopk>, Int<Cfg::HT>>{});

  float neg_lse[Cfg::HT / 8][2];
  load_neg_lse<Cfg>(neg_lse, p, c, lane);

  RingPos<Cfg> pos;
  for (int block = consumer; block < c.num_blocks; block += kNumConsumers) {
    // This thread's two rows' slot indices; the loads overlap the GEMM.
    const int t0 = block * kBlockTopk + 16 * warp + lane / 4;
    const int32_t index0 = load_slot_index(c, t0, p.topk);
    const int32_t index1 = load_slot_index(c, t0 + 8, p.topk);
    qk_gemm_block<Cfg>(plan, mma, tA, tB, acc, consumer, block == consumer, pos, lane);
    softmax_sum_store<Cfg>(acc, neg_lse, p, c, block, warp, lane, key_if_valid(c, index0, p.s_kv) >= 0,
                           key_if_valid(c, index1, p.s_kv) >= 0);
  }
}

// ---------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------
template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    attn_dist_kernel(const __grid_constant__ AttnDistParams params, const __grid_constant__ TmaParams tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Plan = typename Cfg::SharedMemoryPlan;
  extern __shared__ char smem_raw[];
  Plan& plan = *reinterpret_cast<Plan*>((reinterpret_cast<uintptr_t>(smem_raw) + kSmemAlign - 1) &
                                        ~uintptr_t(kSmemAlign - 1));
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int thread_in_wg = threadIdx.x % kWarpgroupThreads;
  const CtaProblem cta = locate_cta<Cfg>(params);

  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kDimTiles; ++i)
      cutlass::arch::ClusterTransactionBarrier::init(&plan.q_ready[i], Barriers::kQReadyArrivals);
    for (int w = 0; w < kNumConsumers; ++w)
      for (int i = 0; i < Cfg::kStages; ++i) {
        cutlass::arch::ClusterBarrier::init(&plan.k_full[w][i], Barriers::kKFullArrivals);
        cutlass::arch::ClusterBarrier::init(&plan.k_empty[w][i], Barriers::kKEmptyArrivals);
      }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == kNumConsumers) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (thread_in_wg == 0) {
      cute::prefetch_tma_descriptor(&tma.q);
      load_q_by_tma<Cfg>(plan, tma, cta);
    }
    constexpr int kFeeders = kWarpgroupThreads / kNumConsumers;
    gather_k_blocks<Cfg>(plan, params, cta, thread_in_wg / kFeeders, thread_in_wg % kFeeders);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume_blocks<Cfg>(plan, params, cta, warpgroup, thread_in_wg);
  }
#endif
}

// ---------------------------------------------------------------------------
// Host launcher for one (D, HT) variant.
// ---------------------------------------------------------------------------
template <class Cfg>
LaunchStatus run_variant(const AttnDistParams& p, cudaStream_t stream, const char** detail) {
  TmaParams tma{};
  {
    const uint64_t dims[4] = {uint64_t(Cfg::D), uint64_t(p.h_q), uint64_t(p.s_q), uint64_t(p.batch)};
    const uint64_t row = uint64_t(Cfg::D) * sizeof(bf16);
    const uint64_t strides[3] = {row, row * p.h_q, row * p.h_q * p.s_q};  // bytes, dims 1..3
    const uint32_t box[4] = {uint32_t(kDimTile), uint32_t(Cfg::HT), 1, 1};
    const uint32_t elem_strides[4] = {1, 1, 1, 1};
    const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        &tma.q, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(p.q), dims, strides, box, elem_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      *detail = "cuTensorMapEncodeTiled failed for q";
      return LaunchStatus::kTensorMapError;
    }
  }
  auto kernel = &attn_dist_kernel<Cfg>;
  // Per device, so set on every launch (host-side, no synchronisation).
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err == cudaSuccess) {
    const int num_head_tiles = (p.h_q + Cfg::HT - 1) / Cfg::HT;
    const dim3 grid(unsigned(int64_t(p.batch) * p.s_q * num_head_tiles));
    kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(p, tma);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    *detail = cudaGetErrorString(err);
    return LaunchStatus::kLaunchError;
  }
  return LaunchStatus::kOk;
}

}  // namespace attn_dist

// Explicit instantiation, one (D, HT) per translation unit for parallel nvcc.
#define ATTN_DIST_INSTANTIATE(D, HT)                                                           \
  template attn_dist::LaunchStatus attn_dist::run_variant<attn_dist::Config<D, HT>>(            \
      const attn_dist::AttnDistParams&, cudaStream_t, const char**);
