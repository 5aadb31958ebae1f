// Tiles, shared-memory plan and barriers of the SM90 indexer_topk kernel
// (docs/KERNELS.md, "indexer_topk").
//
// One CTA per pair of query rows. The logits are a dense WGMMA
//   acc[key, (row, head)] = K_block[key, d] . Q[(row, head), d]
// with M = 64 consecutive keys (a TMA tile of index_k) and N = 2 rows x 64
// heads, so that each row's weighted relu head sum is a sum along an
// accumulator row (register FMAs and quad shuffles, in a fixed order). The
// keys' logits go to shared memory as order-preserving uint32 keys, one array
// per row; the selection then runs there (select.cuh).
#pragma once

#include <cstdint>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/float8.h>

#include "../common/gather.cuh"
#include "params.h"

namespace attn_dist {
namespace indexer_topk {

// Two consumer warpgroups and one producer warpgroup. The consumers take the
// key blocks of a pair alternately (block j: warpgroup j % 2), so that one's
// epilogue overlaps the other's WGMMAs, and each holds two blocks'
// accumulators (its next block's WGMMAs run under its current block's
// epilogue).
//   Multi-pass kernel (any N; one CTA per pair): afterwards consumer
//   warpgroup r selects row r's keys.
//   Resident kernel (N <= kChunkKeys; one persistent CTA per SM): a fourth,
//   selector warpgroup selects pair i's rows from one logits buffer while the
//   consumers compute pair i + 1's into the other.
constexpr int kRows = 2;                     // query rows per CTA (= consumer warpgroups)
constexpr int kConsumers = kRows;
constexpr int kThreads = (kConsumers + 1) * kWarpgroupThreads;
constexpr int kResidentThreads = (kConsumers + 2) * kWarpgroupThreads;
// setmaxnreg budgets within the launch allocation (65536 / 384 = 170, so 168
// a thread): each consumer holds two 64 x 128 float accumulators (128
// registers) and its weights (32); the producer issues TMA from one thread.
constexpr int kConsumerRegs = 232;
constexpr int kProducerRegs = 40;
static_assert(register_budgets_fit(kThreads, 1, kConsumers * kWarpgroupThreads, kConsumerRegs, kWarpgroupThreads,
                                   kProducerRegs),
              "setmaxnreg budgets exceed the CTA's register allocation");
// The resident kernel's four warpgroups share 128 a thread: the consumers
// take 208 (their code's highest register is R198 in float8, R189 in bf16),
// the selector 56 (R49); the producer's thread, which also walks the pairs,
// spills at 24 in bf16.
constexpr int kResidentConsumerRegs = 208;
constexpr int kResidentProducerRegs = 40;
constexpr int kResidentSelectorRegs = 56;
static_assert(register_budgets_fit(kResidentThreads, 1, kConsumers * kWarpgroupThreads, kResidentConsumerRegs,
                                   kWarpgroupThreads, kResidentProducerRegs, kWarpgroupThreads,
                                   kResidentSelectorRegs),
              "setmaxnreg budgets exceed the resident CTA's register allocation");
constexpr int kBlockKeys = 64;               // keys per WGMMA block (the M of the WGMMA)
// Keys whose logits a row holds in shared memory at once (a chunk). A row
// pair whose keys span more streams its candidates in one pass, or, past
// the streaming topk, runs several passes over its chunks (kernel.cuh).
constexpr int kChunkKeys = 8192;
constexpr int kLogitPad = 16;                // row stride padding: row 1's stores land 16 banks off row 0's
constexpr int kHistBits = 11;                // radix digit of the selection
constexpr int kHistBins = 1 << kHistBits;

// Rows whose keys span several chunks select in one GEMM pass where topk
// allows (kernel.cuh, "Streaming selection"): each row keeps at most
// kCandidates keys in shared memory (order key and key index), in the
// chunk logits' place, and takes a new key only above its cut. After every
// segment of stream_segment_keys(topk) keys both consumers stop between two
// blocks; a row whose candidates might not hold the next segment is cut back
// to its topk best.
constexpr int kCandidates = 4096;            // per row
constexpr int kMaxSegmentKeys = 1024;
constexpr int kMinSegmentKeys = 512;         // past topk = kCandidates - this: a GEMM pass per radix round
__host__ __device__ constexpr int stream_segment_keys(int topk) {
  const int room = (kCandidates - topk) / (2 * 64) * (2 * 64);  // whole blocks, one per consumer
  return room < kMaxSegmentKeys ? room : kMaxSegmentKeys;
}
__host__ __device__ constexpr bool streams(int topk) { return topk >= 1 && stream_segment_keys(topk) >= kMinSegmentKeys; }
static_assert(kMaxSegmentKeys * 2 <= kCandidates, "a row's first segments fill at most half its candidates");

// Named barriers (0 is __syncthreads, used only at set-up).
constexpr int kBarConsumers = 1;             // both consumer warpgroups
constexpr int kBarPass = 2;                  // consumers arrive, the producer warp syncs: the next pass's kind
constexpr int kBarRow0 = 3;                  // + r: consumer warpgroup r alone (resident: the selector, r = 0)

// The index_q/index_k element types the kernel reads. A dim tile is one
// 128-byte swizzle row: 64 bf16 or 128 float8 dims.
using fp8 = cutlass::float_e4m3_t;
template <class Elem>
constexpr int kTileDims = 128 / int(sizeof(Elem));

// DI: indexer head dim. HT: heads per query row in the WGMMA (the variant's
// HI). Elem: bf16, or fp8 (e4m3, products accumulated by the tensor cores).
// Resident: the persistent kernel's plan (two logits buffers, the selector's
// one histogram), else the multi-pass kernel's.
template <int DI_, int HT_, class Elem_, bool kResident_ = false>
struct Config {
  using Elem = Elem_;
  static constexpr bool kResident = kResident_;
  static constexpr int DI = DI_;
  static constexpr int HT = HT_;
  static constexpr int kTile = kTileDims<Elem>;
  static constexpr int kDimTiles = DI / kTile;
  static constexpr int kMmaN = kRows * HT;
  static_assert(DI % kTile == 0, "DI must be a whole number of 128-byte rows");
  static_assert(HT == 64, "the kernel is built for 64 heads per row (WGMMA N = 128)");

  // Q: the two rows' heads (row-major (row, head)), all DI dims, K-major with
  // the 128-byte swizzle, one (kMmaN x kTile) tile per dim tile. Written by TMA.
  static constexpr int kQTileBytes = kMmaN * 128;
  static constexpr int kQBytes = kQTileBytes * kDimTiles;  // one buffer

  // A stage is one block: 64 keys x DI dims, as kDimTiles (64 x kTile) tiles.
  static constexpr int kKeyTileBytes = kBlockKeys * 128;
  static constexpr int kStageBytes = kKeyTileBytes * kDimTiles;
  static constexpr int kLogitRowWords = kChunkKeys + kLogitPad;
  static constexpr int kLogitBuffers = kResident ? 2 : 1;
  static constexpr int kHistRows = kResident ? 1 : kRows;  // the selector takes its rows one at a time
  // Each stage also holds its keys' index_k_scale (below): its slot's bytes.
  static constexpr int kScaleSlotWords = 96;               // a slot: the box rounded up to 128 bytes
  static constexpr int kStageSlotBytes = kStageBytes + kScaleSlotWords * 4;
  static constexpr int fixed_bytes(int q_buffers) {
    return q_buffers * kQBytes + kLogitBuffers * kRows * kLogitRowWords * 4 + kHistRows * kHistBins * 4 + 1024;
  }
  // Resident: two Q buffers (pair parity), so that a pair's Q lands while
  // the consumers finish the previous pair, where they leave room for the
  // even ring's two stages a warpgroup (float8); else one (bf16, whose Q and
  // key tiles are twice the size: the pair's Q loads once the previous
  // pair's WGMMAs are done).
  static constexpr int kQBuffers =
      kResident && (kMaxDynamicSmem - kSmemAlign - fixed_bytes(2)) / kStageSlotBytes >= 2 * kConsumers ? 2 : 1;
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Elem>{},
      cute::Shape<cute::Int<kMmaN>, cute::Int<kTile>, cute::Int<kQBuffers * kDimTiles>>{}));
  static constexpr int kFixedBytes = fixed_bytes(kQBuffers);
  // Block j goes to stage j % kStages and to warpgroup j % 2. A consumer's
  // parity wait cannot tell a phase from the one two before it, and TMA
  // loads need not land in the order they were issued, so each full barrier
  // is waited on by one warpgroup only, which has itself waited for the
  // barrier's previous phase: with an even number of stages a stage's
  // blocks all go to one warpgroup and each stage has one full barrier; with
  // an odd number (the resident bf16 plan, 3) a stage's blocks alternate
  // between the warpgroups, and block j lands on full barrier
  // j % (2 kStages), the (stage, warpgroup) pair's own. The multi-pass plan
  // keeps an even number.
  // Each stage also holds its keys' index_k_scale (a 1-D TMA beside the key
  // tiles), so that the consumers read them from shared memory: loaded from
  // global memory in their loop, they shared a scoreboard with the pair's
  // weights, and each block's first weight use waited for them. A TMA box
  // must start 16-byte aligned in global memory, so the box starts at the
  // block's first key rounded down to 4 and holds 4 scales more; its
  // shared-memory slot must start 128-byte aligned, so slots are padded.
  static constexpr int kScaleWords = kBlockKeys + 4;
  static constexpr int kScaleBytes = kScaleWords * 4;      // the box (the stage's transaction bytes)
  static_assert(kScaleWords <= kScaleSlotWords && kScaleSlotWords * 4 % 128 == 0 && kScaleBytes % 16 == 0,
                "a scale box fits its slot, slots start 128-byte aligned, the box is whole 16-byte units");
  static constexpr int kStageMultiple = kResident ? 1 : kConsumers;  // the multi-pass plan: even
  static constexpr int kStages =
      (kMaxDynamicSmem - kSmemAlign - kFixedBytes) / kStageSlotBytes / kStageMultiple * kStageMultiple;
  static_assert(kStages >= 3, "the key ring needs a stage beyond the two blocks in flight");
  // Whether a stage's blocks alternate between the warpgroups (an odd count).
  static constexpr bool kSharedStages = kStages % kConsumers != 0;
  // Full barriers: a (stage, warpgroup) pair's own (above); block j lands on
  // full[j % kRingPeriod], the barrier's phase j / kRingPeriod.
  static constexpr int kRingPeriod = kSharedStages ? kStages * kConsumers : kStages;
  using SmemLayoutK = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Elem>{},
      cute::Shape<cute::Int<kBlockKeys>, cute::Int<kTile>, cute::Int<kStages * kDimTiles>>{}));

  // acc[key, (row, head)] = K_block . Q over one dim tile: a 64 x kMmaN WGMMA
  // chain (K = 16 bf16 or 32 float8 per instruction), both operands K-major.
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<Elem, Elem, float,
                                       cute::Shape<cute::Int<kBlockKeys>, cute::Int<kMmaN>, cute::Int<kTile>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::K>()));

  using Logits = uint32_t[kRows][kLogitRowWords];  // order keys (select.cuh) of the chunk's keys, per row
  // The streaming selection's rows (multi-pass kernel), in the logits' place
  // (candidates(plan): a view, so that the plan, and the code of the kernels
  // that never stream, stay as they are without it).
  struct Candidates {
    uint32_t u[kRows][kCandidates];           // a row's candidates: order keys
    uint32_t key[kRows][kCandidates];         // and key indices
    uint32_t count[kRows];                    // a row's candidates
    uint32_t cut[kRows];                      // a row takes a key only if its order key is above this
  };
  static_assert(sizeof(Candidates) <= sizeof(Logits), "the candidates take the logits' place");
  struct SharedMemoryPlan {
    alignas(kSmemAlign) Elem q[cute::cosize_v<SmemLayoutQ>];
    alignas(kSmemAlign) Elem k[cute::cosize_v<SmemLayoutK>];
    alignas(128) float k_scale[kStages][kScaleSlotWords];  // a stage's scales from (b N + key0) & ~3 (past B N: 0)
    Logits logits[kLogitBuffers];             // resident: pair parity (counted over the CTA's selecting pairs)
    uint32_t hist[kHistRows][kHistBins];      // a row's radix histogram
    uint64_t full[kRingPeriod];               // a block's TMA landed (one arrival + transaction bytes)
    uint64_t empty[kStages];                  // the 4 warps of the consuming warpgroup read the stage
    uint64_t q_ready[kQBuffers];              // a Q buffer landed
    uint64_t q_free[kQBuffers];               // resident: both consumers' WGMMAs of its pair done (8 warps)
    uint64_t logits_full[kLogitBuffers];      // resident: a buffer's logits stored (the 256 consumer threads)
    uint64_t logits_free[kLogitBuffers];      // resident: the selector is done with a buffer (one arrival)
    uint32_t warp_sums[kHistRows][2][4][2];   // per row: two buffers of each warp's count ([..][0]; [..][1] unused)
    uint32_t found[kHistRows][3];             // per row: a radix round's bin, count above it, count in it
    int next_pass_emits;                      // multi-pass: the next pass writes the output
    int row_done[kRows];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + kSmemAlign;  // + base alignment
  static_assert(kSmemBytes <= kMaxDynamicSmem, "shared-memory plan exceeds 227 KiB");
  static __device__ __forceinline__ Candidates& candidates(SharedMemoryPlan& plan) {
    return *reinterpret_cast<Candidates*>(&plan.logits[0]);
  }
};

// Passed by value as a __grid_constant__ kernel parameter.
struct TmaParams {
  CUtensorMap q;  // 4-D (DI, HI, S, B), box (kTile, HT, kRows, 1), SWIZZLE_128B
  CUtensorMap k;  // 3-D (DI, N, B), box (kTile, 64, 1), SWIZZLE_128B
  CUtensorMap k_scale;  // 1-D (B * N) float32, box 68: a block's index_k_scale (from a 16-byte boundary)
};

}  // namespace indexer_topk
}  // namespace attn_dist
