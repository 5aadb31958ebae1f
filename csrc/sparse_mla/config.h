// Tile constants, shared-memory plan, barriers and TMA parameters of the SM90
// sparse MLA forward kernel.
//
// One CTA per (batch, query token, 64-head tile); 3 warpgroups. Heads are
// the M of every WGMMA, so that the score accumulator S[head, key] is, after
// the softmax, already the register A operand of the P.V product.
//   Key blocks of 64 top-k slots alternate between two buffers (block
//   parity); each buffer is one ring of the shared gather pipeline
//   (common/gather.cuh), exactly one block deep (a stage per 64-dim tile),
//   so each dim tile is released on its own as soon as its readers are done.
//   WG0 computes S = Q.K^T of the even blocks, WG1 of the odd ones; each
//   consumer owns half of the output dims (WG0: 0..255, WG1: 256..511) and
//   multiplies every block's P into its half: its own block's from
//   registers, the other's from its shared tile. The softmax's reference
//   (steps.cuh) is exchanged through shared memory once per block pair, so
//   both halves share one softmax.
//   WG2 gathers the key rows (all 128 threads, both buffers by half blocks)
//   and loads Q by TMA.
#pragma once

#include <cstdint>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "../common/gather.cuh"
#include "params.h"

namespace attn_dist {
namespace sparse_mla {

constexpr int kNumConsumers = 2;
constexpr int kThreads = (kNumConsumers + 1) * kWarpgroupThreads;
constexpr int kCtasPerSm = 1;
constexpr int kDv = 512;                              // value dims: the latent's first 512
constexpr int kDvPerConsumer = kDv / kNumConsumers;  // 256: the N of the P.V WGMMA
constexpr int kVTilesPerConsumer = kDvPerConsumer / kDimTile;

// setmaxnreg budgets within the launch allocation (65536 / 384 = 170 a
// thread): the consumers hold a 64x256 f32 output half (128 registers) and
// a 64x64 score block (32); the producer needs about 36.
constexpr int kConsumerRegs = 224;
constexpr int kProducerRegs = 56;
static_assert(register_budgets_fit(kThreads, kCtasPerSm, kNumConsumers * kWarpgroupThreads, kConsumerRegs, kWarpgroupThreads,
                                   kProducerRegs),
              "setmaxnreg budgets exceed the CTA's register allocation");

// Named barriers between the two consumers (ids above CUTLASS's reserved ones).
enum Barrier : uint32_t {
  kMaxOfEvenReady = 0,  // WG0 published the row max after its block
  kReferenceReady = 1,  // WG1 published the pair's reference
  kEvenPReady = 2,      // WG0 wrote its (rescaled) P to shared memory
  kOddPReady = 3,       // WG1 wrote its P to shared memory
  kRowSumsReady = 4,    // both published their row sums; Q is no longer read
  kOutputStaged = 5,    // the output tile is in shared memory
};
constexpr uint32_t kPairThreads = kNumConsumers * kWarpgroupThreads;

// Shared-memory P tiles (64 heads x 64 keys), where they do not share a key buffer.
template <int N>
struct PTiles {
  alignas(kSmemAlign) bf16 tile[N][kBlockTopk * kDimTile];
};
template <>
struct PTiles<0> {};

// D: head dim of q and kv (512 or 576). HT: heads per CTA (64).
template <int D_, int HT_>
struct FwdConfig {
  static constexpr int D = D_;
  static constexpr int HT = HT_;
  static_assert(HT == 64, "heads are the M of the WGMMAs: 64 per CTA");
  static_assert(D % kDimTile == 0 && D >= kDv, "D must be a multiple of 64 and hold the value dims");
  static constexpr int kDimTiles = D / kDimTile;
  static __host__ __device__ constexpr int num_head_tiles(int heads) { return (heads + HT - 1) / HT; }

  // With a rope part (D = 576) the even block's P lives in buffer 0's last
  // dim tile, which only S0 reads, and before P exists; the odd block's P has
  // a tile of its own, so that buffer 1's rope tile is free once S1 has read
  // it. At D = 512 both have tiles of their own.
  static constexpr bool kHasRopeTile = kDimTiles > kDv / kDimTile;
  static constexpr int kPTiles = kHasRopeTile ? 1 : kNumConsumers;

  // One ring per block parity, one block deep, each fed by all 128 producer
  // threads in turn (kernel.cuh, gather_block_pairs): 4 rows a thread.
  using Ring = GatherRing<kDimTiles, kNumConsumers>;
  // The producer fills a pair's half blocks in the order they are freed and
  // needed: buffer 0's tiles 0..3, buffer 1's 4.., buffer 0's 4.., buffer
  // 1's 0..3; S1 reads buffer 1 from tile 4 on.
  static constexpr int kOddFirstTile = kVTilesPerConsumer;

  // Q: 64 heads x D, K-major with the 128-byte swizzle; mode 2 picks the
  // 64-dim tile. Written by TMA (SWIZZLE_128B).
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<HT>, cute::Int<kDimTile>, cute::Int<kDimTiles>>{}));
  // P: 64 heads x 64 keys, the same layout as one stage (an A operand).
  using SmemLayoutP = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<bf16>{},
                                                   cute::Shape<cute::Int<HT>, cute::Int<kBlockTopk>>{}));
  // A consumer's value tiles: 4 consecutive stages (64 keys x 256 dims,
  // K-major) seen as the (dims, keys) B operand of P.V, dims contiguous.
  using SmemLayoutKHalf = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<kBlockTopk>, cute::Int<kDvPerConsumer>>{}, cute::Step<cute::_1, cute::_2>{}));
  using SmemLayoutV = decltype(cute::composition(
      SmemLayoutKHalf{},
      cute::Layout<cute::Shape<cute::Int<kDvPerConsumer>, cute::Int<kBlockTopk>>,
                   cute::Stride<cute::Int<kBlockTopk>, cute::_1>>{}));

  // The output tile staged for coalesced stores in the two key buffers after
  // the last block: row-major, rows padded by 16 bytes so that a quad's rows
  // fall on distinct banks.
  static constexpr int kStagedRowElems = kDv + 8;
  static_assert(HT * kStagedRowElems <= kNumConsumers * int(cute::cosize_v<typename Ring::SmemLayout>),
                "the output tile must fit in the key buffers");

  using MmaQK = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<bf16, bf16, float,
                                       cute::Shape<cute::Int<HT>, cute::Int<kBlockTopk>, cute::Int<kDimTile>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::K>()));
  using MmaPV = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<bf16, bf16, float,
                                       cute::Shape<cute::Int<HT>, cute::Int<kDvPerConsumer>, cute::Int<kBlockTopk>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  // The same product with P from registers: a consumer's own block, whose
  // score accumulator is, in its C layout's element order, the A operand.
  using MmaPVRegs = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::rs_op_selector<bf16, bf16, float,
                                       cute::Shape<cute::Int<HT>, cute::Int<kDvPerConsumer>, cute::Int<kBlockTopk>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>()));

  struct SharedMemoryPlan {
    alignas(kSmemAlign) bf16 q[cute::cosize_v<SmemLayoutQ>];
    alignas(kSmemAlign) bf16 kv[kNumConsumers][Ring::kRingElems];
    PTiles<kPTiles> p;
    typename Ring::Barriers ring;
    uint64_t q_ready[kDimTiles];  // TMA of Q's dim tile landed
    // Per pair parity, defensively: the named barriers already order each
    // write after the other consumer's read of the pair before.
    float max_of_even[2][HT];     // row max after the even block of a pair (WG0 -> WG1)
    float reference_of_pair[2][HT];  // the softmax reference after the pair (WG1 -> WG0)
    float row_sum[kNumConsumers][HT];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + kSmemAlign;  // + base alignment
  static_assert(kSmemBytes <= kMaxDynamicSmem, "shared-memory plan too large");

  // Warpgroups that read each stage (release it): buffer 0 is the even
  // blocks' (WG0 computes S), buffer 1 the odd ones' (WG1). Dim tiles
  // 0..3 are WG0's value half, 4..7 WG1's.
  static __device__ __forceinline__ int stage_readers(int buffer, int dim_tile) {
    // Buffer 0's rope tile: S0's warpgroup, and WG1's P0 . V0 reads P0 there; buffer 1's: S1 alone.
    if (dim_tile >= kDv / kDimTile) return buffer == 0 ? 2 : 1;
    const int value_owner = dim_tile / kVTilesPerConsumer;
    return value_owner == buffer ? 1 : 2;
  }
};

// Passed by value as a __grid_constant__ kernel parameter.
struct TmaParams {
  CUtensorMap q;  // 4-D (D, H, S, B) bf16, box (64, 64, 1, 1), SWIZZLE_128B
};

}  // namespace sparse_mla
}  // namespace attn_dist
