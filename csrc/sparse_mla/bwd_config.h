// Tile constants, shared-memory plan, barriers and TMA parameters of the SM90
// sparse MLA backward kernel (the steps: bwd_kernel.cuh).
//
// One CTA per (batch, query token, 64-head tile); 3 warpgroups. Q (64 x D)
// and dO (64 x 512) stay in shared memory for the whole row; key blocks of
// 64 top-k slots arrive through one ring of the shared gather pipeline
// (common/gather.cuh), one block deep (a stage per 64-dim tile). Per block:
//   WG0  S = Q.K^T, P = exp2(S - lse) into shared memory;
//   WG1  dP = dO.V^T, then dS = P (dP - delta) sm_scale into shared memory;
//   both dQ += dS.K over their dim tiles (WG0: 0..3 and the rope tile, WG1:
//        4..7), releasing the key stages, then the block's dKV = dS^T.Q +
//        P^T.dO, 64 keys x 64 dims at a time (WG0: the rope tile and value
//        tiles 0..kWg0ValueTiles-1, WG1 the rest), reduced into the kv
//        gradient from registers (float32 atomics, or 64-bit fixed-point
//        integer atomics in the deterministic mode).
//   WG2  gathers the next block while the consumers work on dKV, and loads
//        Q and dO by TMA.
// Shared memory holds exactly one key block: Q, dO, one block and the P and
// dS tiles take 224 KiB of the 227.
//
// Head-tile pairs. The kv gradient's reductions bound the kernel (L2
// atomics: S.T.D.4 bytes per head tile, 8 in the deterministic mode's 64-bit
// terms), so where a token has an even number of head tiles, the kernel runs
// the two tiles of each pair as a 2-CTA cluster that reduces every dKV tile
// once. Each dKV tile is split by columns: rank r reduces columns
// [32r, 32r + 32) of it. Warpgroup w of each rank sends the other half of its
// 64 x 64 float partial, rounded to bf16, into the partner's landing for
// warpgroup w (ring stage 6 + w, which no WGMMA reads between the block's dQ
// and the next gather) by st.async, which completes on the partner's
// recv_full[w]; it adds the partner's half of its own columns and reduces
// them. (The exchange is bound by its bytes through the cluster's
// shared-memory network: in float32 as many as the L2 reductions it saves.)
// Both ranks' warps do the same work. Float32: the landing is freed as soon
// as it is read, before the vector atomics from registers. Deterministic: each
// warp stages its merged rows' fixed-point terms in its own kilobyte of the
// landing's upper half, 8 rows of 16 columns at a time, and adds them by
// 64-bit integer reductions, a warp instruction two rows' whole 128-byte
// lines; the landing is freed once they are read. Either way it goes to the
// partner's next half, or after the block's last tile to the gather.
#pragma once

#include <cstdint>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "../common/gather.cuh"
#include "params.h"

namespace attn_dist {
namespace sparse_mla {

namespace bwd {

constexpr int kNumConsumers = 2;
constexpr int kThreads = (kNumConsumers + 1) * kWarpgroupThreads;
constexpr int kDv = 512;
constexpr int kValueTiles = kDv / kDimTile;              // 8
constexpr int kDqTilesPerConsumer = kValueTiles / 2;     // 4 value tiles each; WG0 also the rope
constexpr int kDqValueDims = kDqTilesPerConsumer * kDimTile;  // 256: the N of a dQ WGMMA

// setmaxnreg budgets within the launch allocation (65536 / 384 = 170, so 168
// a thread): WG0 holds a 64 x 320 float dQ (160 registers) beside a 64 x 64
// accumulator. An increase past the launch allocation would wait forever.
constexpr int kConsumerRegs = 224;
constexpr int kProducerRegs = 56;
static_assert(register_budgets_fit(kThreads, 1, kNumConsumers * kWarpgroupThreads, kConsumerRegs, kWarpgroupThreads,
                                   kProducerRegs),
              "setmaxnreg budgets exceed the CTA's register allocation");

// The landings of a head-tile pair's dKV halves: warpgroup w's in ring stage
// kLandingStage + w (value tiles that, after the scores, only WG1's dQ reads).
constexpr int kLandingStage = 6;
constexpr int kLandingStages = kNumConsumers;
// A dKV tile's columns that each rank of a pair reduces.
constexpr int kPairDimsPerRank = kDimTile / 2;
// Arrivals on a CTA's send_free barriers (the partner's warps arrive): after
// the block's dQ every warp of both of the partner's consumers arrives once on
// each, after each merged tile but the block's last the partner's warpgroup's
// 4 warps twice.
constexpr uint32_t kSendFreeArrivals = 8;
// A half tile (64 x 32, as bf16 pairs) completes recv_full as st.async
// transactions; the receiving warpgroup's thread 0 arms it (one arrival) with
// the bytes expected. The landing is a whole ring stage: the deterministic
// mode stages its fixed-point rows in the half past the half tile.
constexpr uint32_t kHalfTileBytes = 64 * kPairDimsPerRank * 2;
constexpr uint32_t kLandingBytes = 64 * kPairDimsPerRank * sizeof(float);
constexpr uint32_t kRecvFullArrivals = 1;

// Named barriers between the consumers (ids above CUTLASS's reserved ones).
enum Barrier : uint32_t {
  kPReady = 0,       // WG0 wrote the block's P
  kDsReady = 1,      // WG1 wrote the block's dS
  kWg0DkvDone = 2,   // WG0's WGMMAs of the block no longer read P or dS
  kWg1DkvDone = 3,   // WG1's likewise
  kDsStored = 4,     // WG1 (alone): all its threads wrote dS
  kNumBarriers
};
// CUTLASS's NamedBarrier adds its 8 reserved ids; the hardware has 16.
static_assert(kNumBarriers + 8 <= 16, "named barrier ids past the hardware's 16");
constexpr uint32_t kPairThreads = kNumConsumers * kWarpgroupThreads;

}  // namespace bwd

// D: head dim of q and kv (512 or 576). HT: heads per CTA (64).
template <int D_, int HT_, bool kDeterministic_>
struct BwdConfig {
  static constexpr int D = D_;
  static constexpr int HT = HT_;
  static constexpr bool kDeterministic = kDeterministic_;
  static_assert(HT == 64, "heads are the M of the WGMMAs: 64 per CTA");
  static_assert(D % kDimTile == 0 && D >= bwd::kDv, "D must be a multiple of 64 and hold the value dims");
  static constexpr int kDimTiles = D / kDimTile;
  static constexpr int kRopeTiles = kDimTiles - bwd::kValueTiles;
  static_assert(kRopeTiles <= 1, "WG0 holds at most one rope tile of dQ");
  static __host__ __device__ constexpr int num_head_tiles(int heads) { return (heads + HT - 1) / HT; }
  // Head tiles run as 2-CTA clusters that merge their dKV partials (above).
  static __host__ __device__ constexpr bool paired_head_tiles(int heads) {
    return num_head_tiles(heads) % 2 == 0;
  }

  // The dKV tiles: WG0 takes the rope tile and value tiles 0..kWg0ValueTiles-1
  // (its S product is longer than WG1's dP by the rope tile), WG1 the rest.
  static constexpr int kWg0ValueTiles = kRopeTiles ? 3 : 4;

  // One ring, one block deep, read by both consumers.
  using Ring = GatherRing<kDimTiles, 1>;
  // The gather fills a block's stages, and S reads them, from the rope tile
  // on (8, 0, 1, .., 7): the landings (stages 6 and 7), which a pair frees
  // only after the block's last merges, come last, so that the next block's
  // S does not wait for them behind the rope stage (dP reads 0..7 anyway).
  static constexpr int kFirstFilledTile = kRopeTiles ? bwd::kValueTiles : 0;

  // Q and dO: 64 heads x 64-dim tiles, K-major, 128-byte swizzle (TMA-written).
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<HT>, cute::Int<kDimTile>, cute::Int<kDimTiles>>{}));
  using SmemLayoutDO = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<HT>, cute::Int<kDimTile>, cute::Int<bwd::kValueTiles>>{}));
  // One 64 x 64 tile, K-major: P and dS (heads x keys), a stage (keys x dims),
  // a tile of Q or dO (heads x dims).
  using SmemLayoutTile = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<bf16>{},
                                                      cute::Shape<cute::Int<64>, cute::Int<64>>{}));
  // The same tile transposed: (column, row), the column contiguous: the
  // MN-major operand view (P^T and dS^T as A; a stage, Q or dO tile as B).
  using SmemLayoutTileT = decltype(cute::composition(
      SmemLayoutTile{}, cute::Layout<cute::Shape<cute::_64, cute::_64>, cute::Stride<cute::_64, cute::_1>>{}));
  // Four consecutive stages (64 keys x 256 dims, K-major) seen as the (dims,
  // keys) B operand of dQ += dS.K, dims contiguous.
  using SmemLayoutK4 = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<kBlockTopk>, cute::Int<bwd::kDqValueDims>>{}, cute::Step<cute::_1, cute::_2>{}));
  using SmemLayoutK4T = decltype(cute::composition(
      SmemLayoutK4{}, cute::Layout<cute::Shape<cute::Int<bwd::kDqValueDims>, cute::Int<kBlockTopk>>,
                                   cute::Stride<cute::Int<kBlockTopk>, cute::_1>>{}));

  // S = Q.K^T and dP = dO.V^T: heads x keys, both operands K-major.
  using MmaScores = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<bf16, bf16, float,
                                       cute::Shape<cute::Int<HT>, cute::Int<kBlockTopk>, cute::Int<kDimTile>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::K>()));
  // dQ += dS.K: heads x 256 dims (four value tiles) or x 64 (the rope tile).
  using MmaDq4 = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<bf16, bf16, float,
                                       cute::Shape<cute::Int<HT>, cute::Int<bwd::kDqValueDims>, cute::Int<kBlockTopk>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  using MmaDq1 = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<bf16, bf16, float,
                                       cute::Shape<cute::Int<HT>, cute::Int<kDimTile>, cute::Int<kBlockTopk>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  // dKV = dS^T.Q + P^T.dO: keys x 64 dims, reduced over the heads; both
  // operands transposed views (MN-major).
  using MmaDkv = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<bf16, bf16, float,
                                       cute::Shape<cute::Int<kBlockTopk>, cute::Int<kDimTile>, cute::Int<HT>>,
                                       cute::GMMA::Major::MN, cute::GMMA::Major::MN>()));

  static constexpr int kTileElems = 64 * kDimTile;

  struct SharedMemoryPlan {
    alignas(kSmemAlign) bf16 q[cute::cosize_v<SmemLayoutQ>];
    alignas(kSmemAlign) bf16 dout[cute::cosize_v<SmemLayoutDO>];
    alignas(kSmemAlign) bf16 kv[Ring::kRingElems];
    alignas(kSmemAlign) bf16 p[kTileElems];   // P (bf16), heads x keys
    alignas(kSmemAlign) bf16 ds[kTileElems];  // dS * sm_scale (bf16), heads x keys
    typename Ring::Barriers ring;
    uint64_t q_ready[kDimTiles];             // TMA of Q's dim tile landed
    uint64_t dout_ready[bwd::kValueTiles];   // TMA of dO's dim tile landed
    // Paired, per consumer warpgroup w: the partner's landing w may take this
    // CTA's next half tile; the partner's half tile is in this CTA's landing w.
    uint64_t send_free[bwd::kNumConsumers];
    uint64_t recv_full[bwd::kNumConsumers];
  };
  static_assert(bwd::kLandingBytes == Ring::kStageBytes, "a landing (a ring stage) holds 64 x 32 floats");
  static_assert(bwd::kLandingStage >= bwd::kDqTilesPerConsumer && bwd::kLandingStage + bwd::kLandingStages == bwd::kValueTiles,
                "the landing is the last value stages, which only WG1's dQ reads after the scores");
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + kSmemAlign;  // + base alignment
  static_assert(kSmemBytes <= kMaxDynamicSmem, "shared-memory plan too large");
};

// Passed by value as a __grid_constant__ kernel parameter.
struct BwdTmaParams {
  CUtensorMap q;     // 4-D (D, H, S, B) bf16, box (64, 64, 1, 1), SWIZZLE_128B
  CUtensorMap dout;  // 4-D (512, H, S, B), likewise
};

}  // namespace sparse_mla
}  // namespace attn_dist
