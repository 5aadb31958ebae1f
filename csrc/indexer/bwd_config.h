// Tile constants, shared-memory plan and WGMMA shapes of the SM90 indexer_kl
// backward kernel (docs/SPEC.md §5.3).
//
// One CTA per query row, like the forward: the same gather pipeline feeds the
// row's index_k blocks of 64 slots, the same WGMMA recomputes
//   z[key, head] = K_block[key, :] . Q[head, :]            (64 x HT x DI)
// and the same weighted relu row sum the logits. Then, per block:
//   dz[key, head]   = dl[key] * scale * w[head] * [z > 0]  (registers)
//   dQ^T[dim, head] += K_block^T[dim, key] . dz[key, head]  (64 x HT x 64 per dim
//                     tile: both operands in shared memory, both MN-major; the
//                     K stage is read in place, dz is stored once)
//   dK[key, dim]     = dz[key, head] . Q[head, dim]         (64 x DI x HT: dz from
//                     registers, Q's tiles read MN-major in place)
// and the dK rows, staged in shared memory, are added to d_index_k by bulk
// asynchronous reductions (one per key row, DI float32 sums done in L2). dQ
// and d weights stay in registers over the whole row and are written once.
//
// kDeterministic: the dK rows are rounded to 64-bit fixed-point integers
// (fixed_point.cuh) and added by bulk integer reductions into the workspace,
// 32 dims at a time through two staging buffers: each warp stages and
// reduces its own 16 rows, so a chunk waits only for its warp's reductions
// two chunks back to have been read, and the ring keeps its stages.
//
// Served: DI in {64, 128}, 1 <= HI <= 64 (one head tile: dQ's accumulators
// of every head tile would not fit the registers).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "../common/gather.cuh"
#include "params.h"
#include "config.h"

namespace attn_dist {
namespace indexer {

// The MN-major atom whose swizzle width is one HT-head row of dz (16, 32 or 64 heads).
template <int HT>
using DzAtom = std::conditional_t<HT == 64, cute::GMMA::Layout_MN_SW128_Atom<bf16>,
                                  std::conditional_t<HT == 32, cute::GMMA::Layout_MN_SW64_Atom<bf16>,
                                                     cute::GMMA::Layout_MN_SW32_Atom<bf16>>>;

template <int DI_, int HT_, bool kDeterministic_ = false>
struct BwdConfig {
  static constexpr int DI = DI_;
  static constexpr int HT = HT_;
  static constexpr bool kDeterministic = kDeterministic_;
  static constexpr int kMaxHeadTiles = 1;
  static constexpr int kMaxHeads = HT;
  static constexpr int kDimTiles = DI / kDimTile;
  static_assert(DI % kDimTile == 0, "DI must be a multiple of 64");
  static_assert(HT == 16 || HT == 32 || HT == 64, "head tile is 16, 32 or 64");

  // Q as the forward loads it: (HT heads, 64 dims, dim tile), K-major SW128,
  // one TMA box per dim tile.
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{}, cute::Shape<cute::Int<HT>, cute::Int<kDimTile>, cute::Int<kDimTiles>>{}));
  static constexpr int kQBytes = HT * DI * int(sizeof(bf16));
  static constexpr int kQTileBytes = HT * kDimTile * int(sizeof(bf16));
  // The same bytes as dK's B operand (N = DI dims, K = HT heads), MN-major:
  // a K-major (head, dim) SW128 tile is an MN-major (dim, head) SW128 tile.
  // Dim tiles follow each other every HT * 64 elements (heads tiled first).
  using SmemLayoutQmn = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<bf16>{}, cute::Shape<cute::Int<DI>, cute::Int<HT>>{}, cute::Step<cute::_2, cute::_1>{}));

  // dz as dQ's B operand: (N = HT heads, K = 64 keys), heads contiguous.
  using SmemLayoutDz = decltype(cute::tile_to_shape(DzAtom<HT>{}, cute::Shape<cute::Int<HT>, cute::Int<kBlockTopk>>{}));

  // Two CTAs per SM, registers split by setmaxnreg: the consumer holds dQ
  // (DI x HT), a block's dK (64 x DI) and dz at once, the producer only
  // addresses; 2 x 128 x (producer + consumer) = the SM's 64 K registers.
  // (ptxas -v: no spills at these counts.)
  static constexpr int kCtasPerSm = 2;
  static constexpr int kProducerRegs = HT == 64 ? 32 : 40;
  static constexpr int kConsumerRegs = HT == 64 ? 224 : 216;
  static_assert(register_budgets_fit(kThreads, kCtasPerSm, kWarpgroupThreads, kConsumerRegs, kWarpgroupThreads,
                                     kProducerRegs),
                "setmaxnreg budgets exceed the CTA's register allocation");
  static constexpr int kSmemBudget = smem_budget(kCtasPerSm);
  static constexpr int kMiscBytes = 2048;  // barriers, weights, keys, the reductions' scratch (rounded up)
  static constexpr int kDzBytes = HT * kBlockTopk * int(sizeof(bf16));
  // A block's dK rows, float32, each row contiguous (a bulk reduction's
  // source) and padded by 32 bytes: the 8 rows a warp's float2 stores touch
  // then fall on 4 distinct bank groups (2 wavefronts, the minimum).
  static constexpr int kDkRowFloats = DI + 8;
  // Deterministic: two buffers of a 32-dim chunk per row as int64, rows
  // padded by 32 bytes (a warp's 16-byte stores of 8 rows then take 4
  // wavefronts, the minimum).
  static constexpr int kFixedChunkDims = 32;
  static constexpr int kFixedChunks = DI / kFixedChunkDims;
  static constexpr int kFixedBuffers = 2;
  static constexpr int kDkRowFixed = kFixedChunkDims + 4;
  using DkStage = std::conditional_t<kDeterministic, long long[kFixedBuffers][kBlockTopk][kDkRowFixed],
                                     float[kBlockTopk][kDkRowFloats]>;
  static constexpr int kDkStageBytes = int(sizeof(DkStage));
  static constexpr int kStages =
      (kSmemBudget - kSmemAlign - kQBytes - kDzBytes - kDkStageBytes - kMiscBytes) / (64 * kDimTile * 2);
  static_assert(kStages >= 2 * kDimTiles, "two blocks must fit in the ring");
  using Ring = GatherRing<kStages, kNumConsumers>;

  // A ring stage as dQ's A operand: (M = 64 dims, K = 64 keys, stage),
  // MN-major: the same bytes as the gather's K-major (key, dim) stages.
  using SmemLayoutKmn = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<kDimTile>, cute::Int<kBlockTopk>, cute::Int<kStages>>{}));
  static_assert(cute::cosize_v<SmemLayoutKmn> == Ring::kRingElems, "the MN view must cover the ring exactly");

  using TiledMma = KeyBlockMma<HT>;  // z
  using DqMma = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<bf16, bf16, float,
                                       cute::Shape<cute::Int<kDimTile>, cute::Int<HT>, cute::Int<kBlockTopk>>,
                                       cute::GMMA::Major::MN, cute::GMMA::Major::MN>()));
  using DkMma = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::rs_op_selector<bf16, bf16, float, cute::Shape<cute::Int<kBlockTopk>, cute::Int<DI>, cute::Int<HT>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>()));

  struct SharedMemoryPlan {
    alignas(kSmemAlign) bf16 q[cute::cosize_v<SmemLayoutQ>];
    alignas(kSmemAlign) bf16 k[kNumConsumers][Ring::kRingElems];
    alignas(kSmemAlign) bf16 dz[cute::cosize_v<SmemLayoutDz>];
    alignas(128) DkStage dk;                 // the block's dK rows (or a chunk of them), reduced into d_index_k
    int32_t row_key[kBlockTopk];             // their keys (-1: invalid slot, no reduction)
    typename Ring::Barriers ring;
    uint64_t q_ready;
    float weights[kMaxHeads];                // the row's weights, 0 past HI
    float dw[kConsumerWarps][kMaxHeads];     // each consumer warp's d weights
    float tau[kConsumerWarps];               // each consumer warp's share of the target mass
    float to_fixed;                          // deterministic mode: 2^F (fixed_point.cuh)
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + kSmemAlign;
  static_assert(kSmemBytes <= kSmemBudget, "shared-memory plan exceeds the per-CTA budget");
};

}  // namespace indexer
}  // namespace attn_dist
