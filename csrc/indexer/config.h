// Tile constants, shared-memory plan and TMA parameters of the SM90 indexer_kl
// forward kernel (docs/SPEC.md §5).
//
// One CTA per query row. Like attn_dist's kernel, each WGMMA is
//   acc[key, head] (+)= K_tile[key, d] . Q_tile[head, d]
// with M = 64 gathered index_k rows and N = HT indexer heads, so the weighted
// head sum of relu(z) that makes a logit is a row sum: register FMAs and two
// quad shuffles, in a fixed order. HI > HT runs several head tiles over the
// same resident key stages.
//
// Several CTAs share an SM (four where the heads fit one tile, else two;
// each within its share of the shared memory): one CTA's pipeline fill and
// final reduction overlap the others' streaming. A row gathers T * DI * 2
// bytes (512 KiB at T = 2048, DI = 128), a few microseconds per CTA, so that
// fill would otherwise cost a large share of the time.
#pragma once

#include <cstdint>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "../common/gather.cuh"
#include "params.h"

namespace attn_dist {
namespace indexer {

// One consumer warpgroup and one producer warpgroup per CTA, several CTAs per
// SM: their consumers alternate between GEMM and epilogue, and their warps
// hide each other's latencies. ncu on idx-v32 at two CTAs per SM (16 warps):
// 2.1 instructions issued per cycle, the largest stalls on global loads and
// fixed-latency dependencies. Where the head tiles are one, four CTAs fit:
// 64 registers a thread at launch, which setmaxnreg splits 40 (producer) /
// 88 (consumer), and 56 KiB of shared memory (at DI = 128: 4 ring stages, two
// blocks). Four took 6-11 % less time than three CTAs of 7 stages
// (docs/PERFORMANCE.md, "Design decisions").
constexpr int kNumConsumers = 1;
constexpr int kThreads = (kNumConsumers + 1) * kWarpgroupThreads;  // + the producer
constexpr int kConsumerWarps = kNumConsumers * 4;

// Shared memory per SM is 228 KiB, of which each CTA's runtime reserve is 1 KiB.
constexpr int smem_budget(int ctas_per_sm) { return (228 * 1024) / ctas_per_sm - 1024; }

// Slot indices (producer and consumer) and targets (consumer) are loaded this
// many blocks ahead: a block is a few hundred cycles of work, an L2 or HBM
// round trip longer.
constexpr int kSlotLookahead = 2;

// The per-thread softmax/KL state that the final reduction combines.
constexpr int kRowStateFloats = 5;  // max, sum of exp, target mass, target x (logit - max), target x log target

// DI: indexer head dim (64 or 128). HT: heads per WGMMA (16, 32 or 64).
// kMaxHeadTiles: head tiles of HT a CTA can hold (HI <= HT * kMaxHeadTiles).
template <int DI_, int HT_, int kMaxHeadTiles_>
struct Config {
  static constexpr int DI = DI_;
  static constexpr int HT = HT_;
  static constexpr int kMaxHeadTiles = kMaxHeadTiles_;
  static constexpr int kMaxHeads = HT * kMaxHeadTiles;
  static constexpr int kDimTiles = DI / kDimTile;
  static_assert(DI % kDimTile == 0, "DI must be a multiple of 64");
  static_assert(HT == 16 || HT == 32 || HT == 64, "head tile is 16, 32 or 64");

  // Q: every head tile, all DI dims, K-major with the 128-byte swizzle; mode 2
  // picks (head tile, dim tile) as ht * kDimTiles + dt. Written by TMA.
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<HT>, cute::Int<kDimTile>, cute::Int<kMaxHeadTiles * kDimTiles>>{}));
  static constexpr int kQBytes = kMaxHeads * DI * int(sizeof(bf16));
  static constexpr int kQTileBytes = HT * kDimTile * int(sizeof(bf16));

  static constexpr int kCtasPerSm = kMaxHeadTiles == 1 ? 4 : 2;
  // setmaxnreg budgets (0: none; the 2-CTA variants have 128 registers a
  // thread at launch).
  static constexpr int kProducerRegs = kCtasPerSm == 4 ? 40 : 0;
  static constexpr int kConsumerRegs = kCtasPerSm == 4 ? 88 : 0;
  static_assert(register_budgets_fit(kThreads, kCtasPerSm, kWarpgroupThreads, kConsumerRegs, kWarpgroupThreads,
                                     kProducerRegs),
                "setmaxnreg budgets exceed the CTA's register allocation");
  static constexpr int kSmemBudget = smem_budget(kCtasPerSm);
  static constexpr int kMiscBytes = 1024;  // barriers, weights' tail, the reduction scratch (rounded up)
  static constexpr int kStages =
      (kSmemBudget - kSmemAlign - kQBytes - kMaxHeads * 4 - kMiscBytes) / (kNumConsumers * 64 * kDimTile * 2);
  static_assert(kStages >= kDimTiles, "a block's dim tiles must fit in a ring at once");
  using Ring = GatherRing<kStages, kNumConsumers>;

  using TiledMma = KeyBlockMma<HT>;

  struct SharedMemoryPlan {
    alignas(kSmemAlign) bf16 q[cute::cosize_v<SmemLayoutQ>];
    alignas(kSmemAlign) bf16 k[kNumConsumers][Ring::kRingElems];
    typename Ring::Barriers ring;
    uint64_t q_ready;                                  // every Q tile landed (one arrival + transaction bytes)
    float weights[kMaxHeads];                          // the row's weights, 0 past HI
    float row_state[kConsumerWarps][kRowStateFloats];  // each consumer warp's combined state
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + kSmemAlign;  // + base alignment
  static_assert(kSmemBytes <= kSmemBudget, "shared-memory plan exceeds the per-CTA budget");
};

// Passed by value as a __grid_constant__ kernel parameter.
struct TmaParams {
  CUtensorMap q;  // 4-D (DI, HI, S, B) bf16, box (64, HT, 1, 1), SWIZZLE_128B
};

}  // namespace indexer
}  // namespace attn_dist
