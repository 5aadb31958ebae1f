// What the indexer_kl forward (kernel.cuh) and backward (bwd_kernel.cuh)
// kernels share: the online row state, the CTA's row, the producer's loads,
// the consumer's per-block logits (64 slots x HT heads WGMMA, then the
// weighted relu head sum), the CTA's set-up and the per-row host launcher.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/gather.cuh"
#include "../common/cta.cuh"
#include "../common/host.h"
#include "../common/prefetch.cuh"
#include "../common/slot_validity.cuh"
#include "config.h"

namespace attn_dist {
namespace indexer {

using namespace cute;

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float exp_approx(float x) { return fast_exp2(x * kLog2e); }  // e^x for x <= 0

__device__ __forceinline__ float log_approx(float x) {  // ln x for x > 0; no ftz: a denormal target keeps its log
  float y;
  asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y * 0.6931471805599453f;
}

// The softmax and KL sums over the slots a thread (then a warp, then the CTA)
// has seen, relative to its running maximum m of the valid logits:
//   l = sum exp(x - m), tau = sum t, tx = sum t (x - m), tlogt = sum t log t.
// Then kl = tlogt - tx + tau log l and lse = m + log l.
struct RowState {
  float m = -INFINITY, l = 0.f, tau = 0.f, tx = 0.f, tlogt = 0.f;

  __device__ __forceinline__ void add(float x, float t) {
    if (x > m) {  // rescale to the new maximum (nothing to rescale before the first slot)
      if (m != -INFINITY) {
        l *= exp_approx(m - x);
        tx += tau * (m - x);
      }
      m = x;
    }
    l += exp_approx(x - m);
    if (t > 0.f) {
      tau += t;
      tx += t * (x - m);
      tlogt += t * log_approx(t);
    }
  }

  __device__ __forceinline__ void merge(const RowState& o) {
    const float M = fmaxf(m, o.m);
    if (M == -INFINITY) return;  // neither has seen a valid slot
    const float a = m == -INFINITY ? 0.f : expf(m - M);
    const float b = o.m == -INFINITY ? 0.f : expf(o.m - M);
    // tau is 0 wherever m is -inf, so the shifts below are never inf * 0.
    tx = (tau > 0.f ? tx + tau * (m - M) : tx) + (o.tau > 0.f ? o.tx + o.tau * (o.m - M) : o.tx);
    l = l * a + o.l * b;
    tau += o.tau;
    tlogt += o.tlogt;
    m = M;
  }

  __device__ __forceinline__ RowState shfl_xor(int mask) const {
    RowState o;
    o.m = __shfl_xor_sync(0xffffffffu, m, mask);
    o.l = __shfl_xor_sync(0xffffffffu, l, mask);
    o.tau = __shfl_xor_sync(0xffffffffu, tau, mask);
    o.tx = __shfl_xor_sync(0xffffffffu, tx, mask);
    o.tlogt = __shfl_xor_sync(0xffffffffu, tlogt, mask);
    return o;
  }
};

// Named barrier 1 over the consumer warpgroups (the producer runs on its own).
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kNumConsumers * kWarpgroupThreads) : "memory");
}

// Per-CTA facts shared by producer and consumers.
struct CtaProblem {
  int batch, s;
  int64_t row;  // b * S + s
  int num_head_tiles;
  RowSlots slots;
};

template <class Cfg>
__device__ __forceinline__ CtaProblem locate_cta(const IndexerProblemParams& p) {
  CtaProblem c;
  c.s = blockIdx.x % p.s_q;
  c.batch = blockIdx.x / p.s_q;
  c.row = int64_t(c.batch) * p.s_q + c.s;
  c.num_head_tiles = (p.h_idx + Cfg::HT - 1) / Cfg::HT;
  c.slots = make_row_slots(p.indices, c.batch, c.s, p.s_q, p.topk, p.s_kv, p.causal, p.q_start, p.k_stride,
                           p.row_ranges);
  return c;
}

// ---------------------------------------------------------------------------
// Producer steps (WG1).
// ---------------------------------------------------------------------------

// The row's slot indices and targets: the producer reads the indices a few
// blocks ahead, the consumer both; their first touch comes from HBM. Also the
// indices of the row of the CTA that takes this one's place next
// (common/prefetch.cuh), so that its first blocks start from L2.
__device__ __forceinline__ void prefetch_row(const IndexerProblemParams& p, const CtaProblem& c, int resident) {
  const int64_t total = int64_t(p.batch) * p.s_q * p.topk;
  const int64_t first = int64_t(c.row) * p.topk;
  // Slots past topk_length (c.slots.topk) are never read.
  prefetch_elems_to_l2(p.indices, total, first, c.slots.topk);
  prefetch_elems_to_l2(p.target, total, first, c.slots.topk);
  prefetch_elems_to_l2(p.indices, total, first + int64_t(resident) * p.topk, p.topk);
}

template <class Cfg>
__device__ __forceinline__ void load_q_by_tma(typename Cfg::SharedMemoryPlan& plan, const TmaParams& tma,
                                              const CtaProblem& c) {
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
      &plan.q_ready, uint32_t(c.num_head_tiles * Cfg::kDimTiles * Cfg::kQTileBytes));
  for (int ht = 0; ht < c.num_head_tiles; ++ht)
    for (int dt = 0; dt < Cfg::kDimTiles; ++dt)
      // Heads past HI are zero-filled by TMA; index_q is read once, so evict it first.
      SM90_TMA_LOAD_4D::copy(&tma.q, &plan.q_ready, uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                             plan.q + (ht * Cfg::kDimTiles + dt) * Cfg::HT * kDimTile, dt * kDimTile,
                             ht * Cfg::HT, c.s, c.batch);
}

// ---------------------------------------------------------------------------
// Consumer steps (WG0).
// ---------------------------------------------------------------------------

// sum over this thread's accumulator columns of weights[col] * relu(z), for
// its two rows (WGMMA 64xN f32 layout: acc(4j + 2*rh + e) is row
// 16w + l/4 + 8rh, column 8j + 2(l%4) + e).
// A thread's weights for one head tile: columns 8j + 2(l%4) and 8j + 2(l%4) + 1.
template <class Cfg>
struct TileWeights {
  float2 w[Cfg::HT / 8];

  __device__ __forceinline__ void load(const float* tile_weights, int lane) {  // from shared memory
    CUTE_UNROLL
    for (int j = 0; j < Cfg::HT / 8; ++j) {
      const uint32_t addr = uint32_t(__cvta_generic_to_shared(tile_weights + 8 * j + 2 * (lane % 4)));
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(w[j].x), "=f"(w[j].y) : "r"(addr));
    }
  }
};

// Two independent FMA chains per row (columns 2(l%4) and 2(l%4)+1), added at
// the end in a fixed order.
template <class Cfg, class Acc>
__device__ __forceinline__ void add_weighted_relu(const Acc& acc, const TileWeights<Cfg>& weights,
                                                  float (&partial)[2]) {
  float even[2] = {0.f, 0.f}, odd[2] = {0.f, 0.f};
  CUTE_UNROLL
  for (int j = 0; j < Cfg::HT / 8; ++j) {
    const float2 w = weights.w[j];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      even[rh] = fmaf(w.x, fmaxf(acc(4 * j + 2 * rh), 0.f), even[rh]);
      odd[rh] = fmaf(w.y, fmaxf(acc(4 * j + 2 * rh + 1), 0.f), odd[rh]);
    }
  }
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) partial[rh] += even[rh] + odd[rh];
}

// Waits for the kDimTiles stages of a consumer's next block; they stay
// resident until release_block.
template <class Cfg>
__device__ __forceinline__ void acquire_block(typename Cfg::SharedMemoryPlan& plan, int consumer,
                                              RingPos<Cfg::kStages>& pos, int (&stage)[Cfg::kDimTiles]) {
  CUTE_UNROLL
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt) {
    stage[dt] = pos.stage;
    wait_stage_full<typename Cfg::Ring>(plan.ring, consumer, pos);
    pos.advance();
  }
}

template <class Cfg>
__device__ __forceinline__ void release_block(typename Cfg::SharedMemoryPlan& plan, int consumer,
                                              const int (&stage)[Cfg::kDimTiles], int lane) {
  CUTE_UNROLL
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt) release_stage<typename Cfg::Ring>(plan.ring, consumer, stage[dt], lane);
}

// The logits of one block of 64 slots: acc = K_block . Q_tile^T per head tile,
// weighted relu row sums added up over the head tiles (partial[rh]: the
// unscaled logit of the thread's row rh, the same in all 4 lanes of a quad).
// On return acc holds the last head tile's z.
template <class Cfg, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void block_logits(typename Cfg::SharedMemoryPlan& plan, TiledMma& mma, const FragA& tA,
                                             const FragB& tB, Acc& acc, const CtaProblem& c,
                                             const int (&stage)[Cfg::kDimTiles], int lane,
                                             const TileWeights<Cfg>& first_tile_weights, float (&partial)[2]) {
  partial[0] = partial[1] = 0.f;
  CUTE_NO_UNROLL
  for (int ht = 0; ht < c.num_head_tiles; ++ht) {
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int dt = 0; dt < Cfg::kDimTiles; ++dt) {
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tA); ++kb) {
        cute::gemm(mma, tA(_, _, kb, stage[dt]), tB(_, _, kb, ht * Cfg::kDimTiles + dt), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if constexpr (Cfg::kMaxHeadTiles == 1) {
      add_weighted_relu<Cfg>(acc, first_tile_weights, partial);  // loop-invariant: kept in registers
    } else {
      TileWeights<Cfg> weights;
      weights.load(plan.weights + ht * Cfg::HT, lane);
      add_weighted_relu<Cfg>(acc, weights, partial);
    }
  }
}

// The 4 lanes of a quad hold a row's other columns: a fixed-order butterfly.
__device__ __forceinline__ void quad_sum(float (&partial)[2]) {
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    partial[rh] += __shfl_xor_sync(0xffffffffu, partial[rh], 1);
    partial[rh] += __shfl_xor_sync(0xffffffffu, partial[rh], 2);
  }
}

// ---------------------------------------------------------------------------
// CTA set-up, the producer's row and the row's weights.
// ---------------------------------------------------------------------------

// The CTA's shared-memory plan at the next 1 KiB boundary, its barriers
// initialised and visible to every thread.
template <class Cfg>
__device__ __forceinline__ typename Cfg::SharedMemoryPlan& init_plan(char* smem_raw) {
  using Plan = typename Cfg::SharedMemoryPlan;
  Plan& plan = aligned_plan<Plan>(smem_raw);
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&plan.q_ready, 1);
    Cfg::Ring::init(plan.ring);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  return plan;
}

// The producer warpgroup's row: one thread prefetches the row's indices and
// targets and loads index_q by TMA; all feed the gather rings (slot indices
// kLookahead blocks ahead).
template <class Cfg, int kLookahead>
__device__ __forceinline__ void produce_row(typename Cfg::SharedMemoryPlan& plan, const IndexerProblemParams& params,
                                            const TmaParams& tma, const CtaProblem& cta, int thread_in_wg) {
  if (thread_in_wg == 0) {
    prefetch_row(params, cta, resident_ctas(Cfg::kCtasPerSm));
    cute::prefetch_tma_descriptor(&tma.q);
    load_q_by_tma<Cfg>(plan, tma, cta);
  }
  constexpr int kFeeders = Cfg::Ring::kFeeders;
  const int consumer = thread_in_wg / kFeeders;
  const bf16* keys = static_cast<const bf16*>(params.index_k) + int64_t(cta.batch) * params.s_kv * Cfg::DI;
  gather_key_blocks<typename Cfg::Ring, Cfg::DI, kLookahead>(plan.k[consumer], plan.ring, cta.slots, keys,
                                                             consumer, thread_in_wg % kFeeders);
}

// The row's weights, zero past HI (those heads' zero-filled index_q give
// z = 0 anyway; a zero weight keeps them out whatever the padding holds).
// Loaded by the consumers alone (threads 0 .. 128 kNumConsumers - 1), so
// that the producer starts at once.
template <class Cfg>
__device__ __forceinline__ void load_row_weights(typename Cfg::SharedMemoryPlan& plan,
                                                 const IndexerProblemParams& params, const CtaProblem& cta) {
  const float* weights_row = params.weights + cta.row * params.h_idx;
  for (int h = threadIdx.x; h < Cfg::kMaxHeads; h += kNumConsumers * kWarpgroupThreads)
    plan.weights[h] = h < params.h_idx ? __ldg(weights_row + h) : 0.f;
  consumer_sync();
}

// ---------------------------------------------------------------------------
// Host launcher.
// ---------------------------------------------------------------------------
// One CTA per row (B x S) of `kernel` (the forward or the backward), after
// the checks both share and the index_q head-tile map. T = 0 (or N = 0) is
// served: every slot is invalid; the consumers still wait for the index_q TMA
// before the CTA exits.
template <class Cfg, class Params>
LaunchStatus launch_per_row(void (*kernel)(Params, TmaParams), const Params& p, cudaStream_t stream,
                            const char** detail) {
  if (p.batch < 1 || p.s_q < 1 || p.topk < 0 || p.h_idx < 1 || p.h_idx > Cfg::kMaxHeads || p.s_kv < 0) {
    *detail = "empty or invalid problem (B, S >= 1, T >= 0, 1 <= HI <= the variant's heads): nothing to launch";
    return LaunchStatus::kInvalidProblem;
  }
  TmaParams tma{};
  if (LaunchStatus s = encode_head_tile_map(&tma.q, p.index_q, Cfg::DI, p.h_idx, p.s_q, p.batch, Cfg::HT, detail);
      s != LaunchStatus::kOk)
    return s;
  return launch_kernel(kernel, int64_t(p.batch) * p.s_q, kThreads, Cfg::kSmemBytes, stream, detail, p, tma);
}

}  // namespace indexer
}  // namespace attn_dist
