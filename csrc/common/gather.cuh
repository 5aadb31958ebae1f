// The gather pipeline shared by the kernels: producer threads (one warpgroup in
// the indexer's kernels, the sparse MLA backward and forward, two in
// attn_dist's) copy the key rows that a query row's top-k slots select into
// rings of shared-memory stages, one ring per consumer warpgroup (in the
// sparse MLA forward, per block parity), where WGMMA reads them.
//
// A stage is one 64-key x 64-dim tile (8 KiB bf16, K-major, 128-byte swizzle:
// a WGMMA operand). In gather_key_blocks consumer c takes the key blocks c,
// c + kConsumers, ...; for each it needs kDims / 64 stages, in dim order or,
// in a ring one block deep, from a given tile on (the sparse MLA forward
// orders its stages itself, with KeyRowFeeder). Invalid
// slots (per RowSlots) are zero-filled without a read, so any index is safe.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>

#include "slot_validity.cuh"
#include "timeline.cuh"

namespace attn_dist {

using bf16 = cutlass::bfloat16_t;

constexpr int kDimTile = 64;            // dims per stage: one 128-byte swizzle row
constexpr int kWarpgroupThreads = 128;
constexpr int kSmemAlign = 1024;        // SW128 atoms repeat every 8 rows x 128 B
constexpr int kMaxDynamicSmem = 227 * 1024;  // sm_90 opt-in limit per block

// setmaxnreg moves registers between a CTA's warpgroups within its launch
// allocation, 65536 / (threads x CTAs per SM) a thread rounded down to a
// multiple of 8 (the allocation unit). The
// warpgroups' budgets must fit in it, or an increase waits forever for
// registers that no warpgroup gives back.
constexpr int launch_registers_per_thread(int threads, int ctas_per_sm) {
  return 65536 / (threads * ctas_per_sm) / 8 * 8;
}
// (other_*: a third kind of warpgroup, where a kernel has one.)
constexpr bool register_budgets_fit(int threads, int ctas_per_sm, int consumer_threads, int consumer_regs,
                                    int producer_threads, int producer_regs, int other_threads = 0,
                                    int other_regs = 0) {
  return consumer_threads * consumer_regs + producer_threads * producer_regs + other_threads * other_regs <=
         launch_registers_per_thread(threads, ctas_per_sm) * threads;
}

// kFeeders_: the producer threads that feed each ring (a warpgroup may feed
// one ring, or several in turn).
template <int kStages_, int kConsumers_, int kFeeders_ = kWarpgroupThreads>
struct GatherRing {
  static constexpr int kStages = kStages_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kFeeders = kFeeders_;
  static constexpr int kRowsPerFeeder = kBlockTopk * 8 / kFeeders;  // 8 feeders share a row (16 B each)
  static constexpr int kStageElems = kBlockTopk * kDimTile;
  static constexpr int kStageBytes = kStageElems * int(sizeof(bf16));
  static_assert(kStages >= 2, "a ring needs at least two stages");
  static_assert(kFeeders % 8 == 0 && kBlockTopk % (kFeeders / 8) == 0, "feeders must tile the stage");

  using SmemLayout = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<kBlockTopk>, cute::Int<kDimTile>, cute::Int<kStages>>{}));

  // mbarrier arrival counts.
  static constexpr int kFullArrivals = kFeeders;  // each feeding thread's cp.async
  static constexpr int kEmptyArrivals = 4;        // one per consumer warp

  // The stage buffers are a plan member of their own, `alignas(kSmemAlign) bf16
  // k[kConsumers][kRingElems]`; the barriers live apart from them, so that no
  // alignment padding follows them.
  static constexpr int kRingElems = int(cute::cosize_v<SmemLayout>);
  struct Barriers {
    uint64_t full[kConsumers][kStages];   // the producer's cp.async for a stage landed
    uint64_t empty[kConsumers][kStages];  // the consumer's WGMMAs finished reading a stage
  };

  // One thread, before the CTA's first __syncthreads.
  static __device__ __forceinline__ void init(Barriers& ring) {
    for (int c = 0; c < kConsumers; ++c)
      for (int i = 0; i < kStages; ++i) {
        cutlass::arch::ClusterBarrier::init(&ring.full[c][i], kFullArrivals);
        cutlass::arch::ClusterBarrier::init(&ring.empty[c][i], kEmptyArrivals);
      }
  }

  // A ring whose stages several warpgroups read (sparse_mla): stage i of
  // ring c is released by readers(c, i) warpgroups, kEmptyArrivals each.
  template <class Readers>
  static __device__ __forceinline__ void init(Barriers& ring, Readers readers) {
    for (int c = 0; c < kConsumers; ++c)
      for (int i = 0; i < kStages; ++i) {
        cutlass::arch::ClusterBarrier::init(&ring.full[c][i], kFullArrivals);
        cutlass::arch::ClusterBarrier::init(&ring.empty[c][i], kEmptyArrivals * readers(c, i));
      }
  }
};

// The WGMMA both kernels run on a ring stage: acc[key, head] (+)= K[key, d] .
// Q[head, d], one warpgroup, 64 keys x HT heads x 16 dims per instruction,
// both operands from shared memory (K-major).
template <int HT>
using KeyBlockMma = decltype(cute::make_tiled_mma(
    cute::SM90::GMMA::ss_op_selector<bf16, bf16, float,
                                     cute::Shape<cute::Int<kBlockTopk>, cute::Int<HT>, cute::Int<kDimTile>>,
                                     cute::GMMA::Major::K, cute::GMMA::Major::K>()));

// Ring position of a consumer's n-th stage use.
template <int kStages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) { stage = 0; phase ^= 1; }
  }
};

// Consumer side: wait until a stage has landed; release it (one lane per warp)
// once the WGMMAs that read it have completed.
template <class Ring>
__device__ __forceinline__ void wait_stage_full(typename Ring::Barriers& ring, int consumer,
                                                const RingPos<Ring::kStages>& pos) {
  cutlass::arch::ClusterBarrier::wait(&ring.full[consumer][pos.stage], pos.phase);
}

template <class Ring>
__device__ __forceinline__ void release_stage(typename Ring::Barriers& ring, int consumer, int stage, int lane) {
  if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&ring.empty[consumer][stage]);
}

// Producer side, one thread's part of every stage it fills: 16-byte chunk
// (feeder % 8) of rows (feeder / 8) + (kFeeders / 8) * r. `keys` is this batch
// element's [N, kDims] key rows. The ring gather below runs it over a ring's
// blocks; a kernel that orders its stages itself (sparse_mla's forward) runs
// it directly.
template <class Ring, int kDims>
struct KeyRowFeeder {
  static_assert(kDims % kDimTile == 0, "key rows must be whole 64-dim tiles");
  static constexpr int kDimTiles = kDims / kDimTile;
  static constexpr int kRows = Ring::kRowsPerFeeder;
  static constexpr int kRowStep = Ring::kFeeders / 8;
  // The 128-byte swizzle (Swizzle<3,4,3>) XORs the 16-byte chunk with row % 8,
  // which is row0 % 8 for all of this thread's rows.
  static_assert(kRowStep % 8 == 0, "each feeder's rows must share row % 8");
  // Each row's source pointer is formed once per block and the dim tiles add
  // immediate offsets. Every ring here has 4 rows a feeder; more 64-bit
  // pointers would crowd the producers' few registers.
  static_assert(kRows <= 4, "a feeder keeps a 64-bit source pointer per row");

  const RowSlots& slots;
  const int row0;
  const int smem_chunk_elems;
  // Rows are addressed by their offset in the row's key range (zero-extended:
  // an offset is valid only when below key_span, which is at most N).
  const bf16* const chunk_base;

  __device__ __forceinline__ KeyRowFeeder(const RowSlots& row_slots, const bf16* keys, int feeder)
      : slots(row_slots),
        row0(feeder / 8),
        smem_chunk_elems(((feeder % 8) ^ (feeder / 8 % 8)) * 8),
        chunk_base(keys + int64_t(row_slots.key_begin) * kDims + feeder % 8 * 8) {}

  // This thread's slot indices of `block` (-1 past T, without a read).
  __device__ __forceinline__ void load_indices(int block, int32_t (&into)[kRows]) const {
    // One base pointer per block; the rows are immediate offsets from it.
    const int32_t* base = slots.indices + block * kBlockTopk + row0;
    const int left = slots.topk - block * kBlockTopk - row0;  // this thread's slots left in the row
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) into[r] = kRowStep * r < left ? __ldg(base + kRowStep * r) : -1;
  }

  // Where this thread's rows of a block come from.
  struct BlockRows {
    const bf16* src[kRows];  // an invalid slot's is its range's first row, which it does not read
    bool valid[kRows];       // else zero-fill
  };
  __device__ __forceinline__ BlockRows block_rows(const int32_t (&indices)[kRows]) const {
    BlockRows b;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const uint32_t offset = slots.key_offset(indices[r]);  // in the row's key range
      b.valid[r] = offset < slots.key_span;
      // 64-bit row offset: offset * kDims passes 2^31 for N > 3.7M at D = 576.
      b.src[r] = chunk_base + uint64_t(b.valid[r] ? offset : 0u) * kDims;
    }
    return b;
  }

  // Dim tile `dt` of the block's rows into `stage` (cp.async, not waited for).
  __device__ __forceinline__ void copy_tile(bf16* stage, const BlockRows& b, int dt) const {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      bf16* dst = stage + (row0 + kRowStep * r) * kDimTile + smem_chunk_elems;
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<const cute::uint128_t*>(b.src[r] + dt * kDimTile),
          *reinterpret_cast<cute::uint128_t*>(dst), b.valid[r]);
    }
  }

  // A stage handed over: once its readers have freed it (`empty`, the
  // opposite of the fill's phase), dim tile `dt` of the block's rows is
  // copied into it; `full` fires when this thread's copies have landed.
  __device__ __forceinline__ void fill_stage(bf16* stage, uint64_t* empty, uint64_t* full, uint32_t free_parity,
                                             const BlockRows& b, int dt) const {
    cutlass::arch::ClusterBarrier::wait(empty, free_parity);
    copy_tile(stage, b, dt);
    cutlass::arch::cpasync_barrier_arrive_noinc(full);
  }
};

// kFeeders threads feed consumer `consumer`'s ring (`stages`: its kStages
// stage buffers) with the key rows of its blocks, kDims / 64 stages per block,
// in dim order from kFirstTile on, wrapping (a ring one block deep, stage =
// dim tile, may fill the stages its readers free last at the end);
// on_filled(block, dim tile) follows each stage's copies. The slot indices
// are loaded kLookahead of this ring's blocks ahead.
template <class Ring, int kDims, int kLookahead = 1, int kFirstTile = 0, class OnFilled = timeline::NoMark>
__device__ __forceinline__ void gather_key_blocks(bf16* stages, typename Ring::Barriers& ring,
                                                  const RowSlots& slots, const bf16* keys, int consumer,
                                                  int feeder, OnFilled on_filled = {}) {
  using Feeder = KeyRowFeeder<Ring, kDims>;
  static_assert(kFirstTile >= 0 && kFirstTile < Feeder::kDimTiles, "kFirstTile: one of the block's dim tiles");
  static_assert(kFirstTile == 0 || Ring::kStages == Feeder::kDimTiles, "a rotated fill: one block deep, stage = dim tile");
  const Feeder f(slots, keys, feeder);
  const int num_blocks = slots.num_blocks();
  RingPos<Ring::kStages> pos;

  // The slot indices are loaded ahead: waiting for them at the start of each
  // block stalled the gather for an L2 round trip per block.
  int32_t ahead[kLookahead][Feeder::kRows];
  CUTE_UNROLL
  for (int a = 0; a < kLookahead; ++a) f.load_indices(consumer + a * Ring::kConsumers, ahead[a]);
  for (int block = consumer; block < num_blocks; block += Ring::kConsumers) {
    const typename Feeder::BlockRows rows = f.block_rows(ahead[0]);
    CUTE_UNROLL
    for (int a = 0; a + 1 < kLookahead; ++a)
      CUTE_UNROLL
      for (int r = 0; r < Feeder::kRows; ++r) ahead[a][r] = ahead[a + 1][r];
    if (block + kLookahead * Ring::kConsumers < num_blocks)
      f.load_indices(block + kLookahead * Ring::kConsumers, ahead[kLookahead - 1]);
    for (int i = 0; i < Feeder::kDimTiles; ++i) {
      const int dt = (i + kFirstTile) % Feeder::kDimTiles;
      const int stage = kFirstTile == 0 ? pos.stage : dt;  // (pos.stage == i where the ring is one block deep)
      f.fill_stage(stages + stage * Ring::kStageElems, &ring.empty[consumer][stage], &ring.full[consumer][stage],
                   pos.phase ^ 1, rows, dt);
      on_filled(block, dt);
      pos.advance();
    }
  }
  cute::cp_async_wait<0>();
}

}  // namespace attn_dist
