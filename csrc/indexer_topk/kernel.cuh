// The SM90 indexer_topk kernel and its host launcher (docs/KERNELS.md,
// "indexer_topk").
//
// One CTA per pair of query rows (b, s0), (b, s0 + 1); 3 warpgroups:
//   WG0, WG1  consumers. They take a chunk's key blocks alternately: a
//             64 keys x (2 rows x 64 heads) x DI WGMMA, then per key and row
//             sum_h weights * relu(z * index_k_scale), scaled, stored as an
//             order key in the row's shared-memory array. Each runs two
//             accumulators deep: its next block's WGMMAs are issued before
//             the current block's epilogue. Then WG r selects row r's keys
//             (select.cuh) and writes them.
//   WG2       producer: one thread loads index_q by TMA once and streams the
//             key blocks (dense [64, DI] TMA tiles, and the keys'
//             index_k_scale) through the stage ring.
// A row whose valid keys number at most topk needs no logits: its keys are
// written directly. Otherwise the pair's keys (the union of its selecting
// rows' ranges) are computed in chunks of kChunkKeys. One chunk (any N up to
// 8192): one GEMM pass, whose stores also count the first radix round's
// histogram; the later rounds run on the resident logits.
// Several chunks: one GEMM pass over all of them where topk allows
// (streams(topk), config.h: the streaming selection below); else one GEMM
// pass per radix round (histograms only), then one that writes the output,
// the producer learning from the consumers at each pass's end whether the
// next one writes (kBarPass).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/cta.cuh"
#include "../common/host.h"
#include "../common/slot_validity.cuh"
#include "../common/timeline.cuh"
#include "select.cuh"

namespace attn_dist {
namespace indexer_topk {

using namespace cute;

struct RowInfo {
  int64_t row;        // b * S + s
  bool present;       // s < S
  bool select;        // more valid keys than topk: the logits are needed
  uint32_t begin, span;
};

// Per-CTA facts, the same in every thread.
struct CtaProblem {
  int batch, s0;
  RowInfo rows[kRows];
  bool any_select;
  uint32_t begin, end;  // the keys the logits are computed for: the selecting rows' ranges' union
  int num_chunks;

  __device__ __forceinline__ uint32_t chunk_begin(int c) const { return begin + uint32_t(c) * kChunkKeys; }
  __device__ __forceinline__ int chunk_keys(int c) const { return int(min(end - chunk_begin(c), uint32_t(kChunkKeys))); }
  __device__ __forceinline__ int chunk_blocks(int c) const { return (chunk_keys(c) + kBlockKeys - 1) / kBlockKeys; }
};

// Row pairs run from the end of the sequence (the longest causal rows) down,
// the batch elements interleaved, so that the long rows start first: pair
// `linear` of the order.
__device__ __forceinline__ int num_pairs(const IndexerTopkParams& p) { return p.batch * ((p.s_q + 1) / 2); }
__device__ __forceinline__ CtaProblem locate_pair(const IndexerTopkParams& p, int linear) {
  CtaProblem c;
  const int pairs = (p.s_q + 1) / 2;
  c.batch = int(uint32_t(linear) % uint32_t(p.batch));
  c.s0 = 2 * (pairs - 1 - int(uint32_t(linear) / uint32_t(p.batch)));
  c.any_select = false;
  c.begin = 0xFFFFFFFFu;
  c.end = 0u;
  for (int r = 0; r < kRows; ++r) {
    RowInfo& ri = c.rows[r];
    const int s = c.s0 + r;
    ri.row = int64_t(c.batch) * p.s_q + s;
    ri.present = s < p.s_q;
    const KeyRange keys = ri.present ? make_key_range(c.batch, s, p.s_q, p.s_kv, p.causal, p.q_start, p.k_stride,
                                                      p.row_ranges)
                                     : KeyRange{0u, 0u};
    ri.begin = keys.begin;
    ri.span = keys.span;
    ri.select = keys.span > uint32_t(p.topk);
    if (ri.select) {
      c.any_select = true;
      c.begin = min(c.begin, keys.begin);
      c.end = max(c.end, keys.begin + keys.span);
    }
  }
  c.num_chunks = c.any_select ? int((c.end - c.begin + kChunkKeys - 1) / kChunkKeys) : 0;
  return c;
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kBarConsumers), "n"(kConsumers * kWarpgroupThreads) : "memory");
}
constexpr int kPassThreads = kConsumers * kWarpgroupThreads + 32;  // + the producer warp

// Thread 0, before the CTA's first barrier: the key ring's barriers and each
// Q buffer's landing barrier (the barriers both kernels share).
template <class Cfg>
__device__ __forceinline__ void init_ring_and_q(typename Cfg::SharedMemoryPlan& plan) {
  for (int i = 0; i < Cfg::kRingPeriod; ++i) cutlass::arch::ClusterBarrier::init(&plan.full[i], 1);
  for (int i = 0; i < Cfg::kStages; ++i)
    cutlass::arch::ClusterBarrier::init(&plan.empty[i], 4);  // the consuming warpgroup's warps
  for (int i = 0; i < Cfg::kQBuffers; ++i) cutlass::arch::ClusterBarrier::init(&plan.q_ready[i], 1);
}

// The pair's Q into L2 ahead of load_q (where it must wait for its buffer).
template <class Cfg>
__device__ __forceinline__ void prefetch_q(const TmaParams& tma, const CtaProblem& c) {
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt) SM90_TMA_LOAD_4D::PREFETCH::copy(&tma.q, dt * Cfg::kTile, 0, c.s0, c.batch);
}

// The pair's Q (both rows' heads, every dim tile) into Q buffer qb.
template <class Cfg>
__device__ __forceinline__ void load_q(typename Cfg::SharedMemoryPlan& plan, const TmaParams& tma, const CtaProblem& c,
                                       int qb) {
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&plan.q_ready[qb], uint32_t(Cfg::kQBytes));
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt)
    SM90_TMA_LOAD_4D::copy(&tma.q, &plan.q_ready[qb], uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                           plan.q + (qb * Cfg::kDimTiles + dt) * Cfg::kMmaN * Cfg::kTile, dt * Cfg::kTile, 0, c.s0,
                           c.batch);
}

// Block j (keys key0 .. key0 + 63; keys past N are zero-filled) and its
// keys' index_k_scale into stage j % kStages, once the consumer has freed it,
// landing on full barrier j % kRingPeriod (config.h).
// The scales' map is flat over (B, N), its box starting at the 16-byte
// boundary at or before the block's first key (scale_shift): a block's keys
// past N read the next batch's (or 0 past the end), and those keys' logits
// are never counted.
template <class Cfg>
__device__ __forceinline__ void load_block(typename Cfg::SharedMemoryPlan& plan, const TmaParams& tma,
                                           const CtaProblem& c, int s_kv, int key0, int j) {
  const int stage = j % Cfg::kStages;
  uint64_t* full = &plan.full[j % Cfg::kRingPeriod];
  cutlass::arch::ClusterBarrier::wait(&plan.empty[stage], uint32_t((j / Cfg::kStages) & 1) ^ 1u);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, uint32_t(Cfg::kStageBytes + Cfg::kScaleBytes));
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt)
    SM90_TMA_LOAD_3D::copy(&tma.k, full, uint64_t(TMA::CacheHintSm90::EVICT_LAST),
                           plan.k + (stage * Cfg::kDimTiles + dt) * kBlockKeys * Cfg::kTile, dt * Cfg::kTile, key0,
                           c.batch);
  // (B * N + 64 < 2^31: run_variant checks it)
  SM90_TMA_LOAD_1D::copy(&tma.k_scale, full, uint64_t(TMA::CacheHintSm90::EVICT_LAST), plan.k_scale[stage],
                         (c.batch * s_kv + key0) & ~3);
}

// ---------------------------------------------------------------------------
// Producer (warp 0 of WG2; lane 0 issues).
// ---------------------------------------------------------------------------
template <class Cfg>
__device__ __forceinline__ void produce(typename Cfg::SharedMemoryPlan& plan, const IndexerTopkParams& p,
                                        const TmaParams& tma, const CtaProblem& c, int lane) {
  if (!c.any_select) return;
  if (lane == 0) {
    cute::prefetch_tma_descriptor(&tma.q);
    cute::prefetch_tma_descriptor(&tma.k);
    cute::prefetch_tma_descriptor(&tma.k_scale);
    load_q<Cfg>(plan, tma, c, 0);
  }
  int j = 0;  // blocks streamed so far (stage j % kStages, its use j / kStages)
  bool emits = c.num_chunks == 1 || streams(p.topk);  // one pass
  for (;;) {
    for (int ch = 0; ch < c.num_chunks; ++ch) {
      const int blocks = c.chunk_blocks(ch);
      if (lane == 0)
        for (int blk = 0; blk < blocks; ++blk, ++j) load_block<Cfg>(plan, tma, c, p.s_kv, int(c.chunk_begin(ch)) + blk * kBlockKeys, j);
    }
    if (emits) break;
    __syncwarp();
    asm volatile("bar.sync %0, %1;" ::"n"(kBarPass), "n"(kPassThreads) : "memory");
    // Lane 0 alone reads the flag, before it issues the pass's loads: the
    // consumers write it again only after those have landed.
    emits = __shfl_sync(0xffffffffu, lane == 0 ? plan.next_pass_emits : 0, 0) != 0;
  }
}

// ---------------------------------------------------------------------------
// Consumers.
// ---------------------------------------------------------------------------

// A thread's weights: accumulator columns 8j + 2(l%4) + {0, 1}, which are
// row j / 8's heads 8(j % 8) + 2(l%4) + {0, 1}; 0 past HI and for a row past S.
template <class Cfg>
struct ColumnWeights {
  float2 w[Cfg::kMmaN / 8];

  __device__ __forceinline__ void load(const IndexerTopkParams& p, const CtaProblem& c, int lane) {
    CUTE_UNROLL
    for (int j = 0; j < Cfg::kMmaN / 8; ++j) {
      const RowInfo& ri = c.rows[j / (Cfg::HT / 8)];
      const int h = 8 * (j % (Cfg::HT / 8)) + 2 * (lane % 4);
      const float* src = p.weights + ri.row * p.h_idx + h;
      w[j].x = ri.present && h < p.h_idx ? __ldg(src) : 0.f;
      w[j].y = ri.present && h + 1 < p.h_idx ? __ldg(src + 1) : 0.f;
    }
  }
};

// relu(z * ks) / |ks| with ks's sign: max(z, 0), or min(z, 0) for ks < 0
// (then times ks: relu(z * ks) = ks * min(z, 0)).
__device__ __forceinline__ float signed_relu(float z, bool negative) { return negative ? fminf(z, 0.f) : fmaxf(z, 0.f); }

// Per (query row, key rh) of this thread: sum over its columns of
// weight * signed_relu(z), two FMA chains (even and odd columns) added at the
// end (WGMMA 64xN f32 layout: acc(4j + 2rh + e) is key 16w + l/4 + 8rh,
// column 8j + 2(l%4) + e).
template <class Cfg, bool kSigned, class Acc>
__device__ __forceinline__ void weighted_head_sums(const Acc& acc, const ColumnWeights<Cfg>& weights,
                                                   const bool (&negative)[2], float (&part)[kRows][2]) {
  constexpr int kJ = Cfg::HT / 8;  // column groups per query row
  CUTE_UNROLL
  for (int row = 0; row < kRows; ++row) {
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const bool neg = kSigned && negative[rh];
      float even = 0.f, odd = 0.f;
      CUTE_UNROLL
      for (int jj = 0; jj < kJ; ++jj) {
        const int jc = row * kJ + jj;
        even = fmaf(weights.w[jc].x, signed_relu(acc(4 * jc + 2 * rh), neg), even);
        odd = fmaf(weights.w[jc].y, signed_relu(acc(4 * jc + 2 * rh + 1), neg), odd);
      }
      part[row][rh] = even + odd;
    }
  }
}

// A block's keys' index_k_scale (times scale) and signs, for this thread's
// two keys (accumulator rows 16w + l/4 + 8rh).
struct KeyScales {
  float ks[2];
  bool negative[2];
};

// Block j's place in the key ring: its full barrier j % kRingPeriod and
// that barrier's phase parity (j / kRingPeriod), and its stage j % kStages
// (the same where kRingPeriod = kStages; config.h). A consumer steps it by
// kConsumers a block, so that its loop divides once a chunk rather than
// twice a block.
template <class Cfg>
struct KeyRingPos {
  int slot;
  uint32_t parity;
  __device__ __forceinline__ static KeyRingPos of(int j) {
    return {j % Cfg::kRingPeriod, uint32_t((j / Cfg::kRingPeriod) & 1)};
  }
  __device__ __forceinline__ int stage() const {
    static_assert(Cfg::kRingPeriod == (Cfg::kSharedStages ? 2 : 1) * Cfg::kStages, "config.h's periods");
    if constexpr (!Cfg::kSharedStages) return slot;
    else return slot < Cfg::kStages ? slot : slot - Cfg::kStages;
  }
  __device__ __forceinline__ KeyRingPos advanced() const {  // block j + kConsumers (kConsumers <= kRingPeriod)
    static_assert(kConsumers <= Cfg::kRingPeriod, "one wrap a step at most");
    const int next = slot + kConsumers;
    return next >= Cfg::kRingPeriod ? KeyRingPos{next - Cfg::kRingPeriod, parity ^ 1u} : KeyRingPos{next, parity};
  }
};

// Where a block's first scale lies in its stage's slot: load_block's box
// starts at the 16-byte boundary at or before it (the same for every block of
// a chunk, whose blocks start 64 keys apart).
__device__ __forceinline__ int scale_shift(const IndexerTopkParams& p, const CtaProblem& c, int ch) {
  return int((uint32_t(c.batch) * uint32_t(p.s_kv) + c.chunk_begin(ch)) & 3u);  // (mod 2^32: mod 4 alike)
}

// The scales of the block at ring position at, from its landed stage (read
// before the warp releases the stage: release_stage).
template <class Cfg>
__device__ __forceinline__ KeyScales stage_key_scales(const typename Cfg::SharedMemoryPlan& plan, KeyRingPos<Cfg> at,
                                                      float scale, int shift, int t) {
  const int warp = t / 32, lane = t % 32;
  KeyScales k;
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const float v = plan.k_scale[at.stage()][shift + 16 * warp + lane / 4 + 8 * rh];
    k.negative[rh] = v < 0.f;
    k.ks[rh] = v * scale;
  }
  return k;
}

// Issues block j's WGMMA chain over its stage into acc, once the stage has
// landed (not committed: the caller commits one group per issued block,
// which its wait counts rely on).
template <class Cfg, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void issue_block(typename Cfg::SharedMemoryPlan& plan, TiledMma& mma, const FragA& tA,
                                            const FragB& tB, Acc& acc, KeyRingPos<Cfg> at, int q_buffer) {
  const int stage = at.stage();
  cutlass::arch::ClusterTransactionBarrier::wait(&plan.full[at.slot], at.parity);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int dt = 0; dt < Cfg::kDimTiles; ++dt) {
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tA); ++kb) {
      cute::gemm(mma, tA(_, _, kb, stage * Cfg::kDimTiles + dt), tB(_, _, kb, q_buffer * Cfg::kDimTiles + dt), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
  }
  warpgroup_fence_operand(acc);
}

// Where the whole pair's keys fit one chunk, the first radix round's
// histogram (the order keys' top kHistBits bits) is counted as the logits are
// stored: each row counts its own keys, chunk positions [first, first + span).
struct FirstDigit {
  bool on = false;
  uint32_t first[kRows] = {};
  uint32_t span[kRows] = {};  // 0: the row needs no selection
};

// Where a warpgroup's blocks of a chunk go: the logits buffer, the
// first-digit count, and (resident kernel) the barrier that frees Q once the
// warpgroup's last WGMMAs of the pair are done.
template <class Cfg>
struct LogitsSink {
  typename Cfg::Logits* logits;
  FirstDigit fd;
  int q_buffer = 0;
  uint64_t* q_free = nullptr;
};

// The warp frees the stage of the block at ring position at, once the
// block's WGMMAs have completed and its scales are read.
template <class Cfg>
__device__ __forceinline__ void release_stage(typename Cfg::SharedMemoryPlan& plan, KeyRingPos<Cfg> at, int t) {
  // Every lane's generic-proxy read of the stage's scales (stage_key_scales)
  // ordered before the release, after which TMA (the async proxy) refills it.
  cutlass::arch::fence_view_async_shared();
  __syncwarp();
  if (t % 32 == 0) cutlass::arch::ClusterBarrier::arrive(&plan.empty[at.stage()]);
}

// A block's logit of one (query row, key) a lane, from acc (its WGMMAs
// completed): the weighted head sums reduced over each quad, lane q holding
// (row q / 2, key m).
struct LaneLogit {
  uint32_t u;  // the logit's order key
  int row, m;  // the query row, the key's place in its block
};
template <class Cfg, class Acc>
__device__ __forceinline__ LaneLogit lane_logit(const Acc& acc, const ColumnWeights<Cfg>& weights, const KeyScales& k,
                                                int t) {
  const int warp = t / 32, lane = t % 32, quad = lane % 4;

  // part[row][rh]: the thread's columns of each (query row, key) sum. A warp
  // whose keys all have index_k_scale >= 0 (the usual case) takes max(z, 0)
  // alone; otherwise each element picks max or min by its key's sign.
  float part[kRows][2];
  if (__all_sync(0xffffffffu, !(k.negative[0] || k.negative[1])))
    weighted_head_sums<Cfg, false>(acc, weights, k.negative, part);
  else
    weighted_head_sums<Cfg, true>(acc, weights, k.negative, part);
  // Quad reduction with a transpose: after it lane q holds (row q / 2, rh q % 2).
  const bool upper = quad & 2, odd_lane = quad & 1;
  float keep[2], send[2];
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    keep[rh] = upper ? part[1][rh] : part[0][rh];
    send[rh] = upper ? part[0][rh] : part[1][rh];
  }
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) keep[rh] += __shfl_xor_sync(0xffffffffu, send[rh], 2);
  float sum = odd_lane ? keep[1] : keep[0];
  sum += __shfl_xor_sync(0xffffffffu, odd_lane ? keep[0] : keep[1], 1);
  const int rh = quad & 1;
  return {order_key(sum * (rh ? k.ks[1] : k.ks[0])), quad >> 1, 16 * warp + lane / 4 + 8 * rh};
}

// The logits of the chunk's block `slot`, whose WGMMAs have completed into
// acc (its stage released): each (key, row) logit stored by one lane (and
// counted in the row's first-digit histogram, where fd.on).
template <class Cfg, class Acc>
__device__ __forceinline__ void finish_block(typename Cfg::SharedMemoryPlan& plan, const Acc& acc,
                                             const ColumnWeights<Cfg>& weights, const KeyScales& k, int slot, int t,
                                             const LogitsSink<Cfg>& sink) {
  const LaneLogit l = lane_logit<Cfg>(acc, weights, k, t);
  const int pos = slot * kBlockKeys + l.m;
  (*sink.logits)[l.row][pos] = l.u;
  const FirstDigit& fd = sink.fd;
  if (fd.on) {
    // (selects, not a runtime index into fd: that would put it in local memory)
    const uint32_t first = l.row ? fd.first[1] : fd.first[0], span = l.row ? fd.span[1] : fd.span[0];
    const bool mine = uint32_t(pos) - first < span;
    shared_add(&plan.hist[l.row][l.u >> (32 - kHistBits)], uint32_t(mine));
  }
}
template <class Cfg>
__device__ __forceinline__ void after_block(typename Cfg::SharedMemoryPlan&, LogitsSink<Cfg>&, int, int) {}

// ---------------------------------------------------------------------------
// Streaming selection: rows whose keys span several chunks, where topk leaves
// a segment of at least kMinSegmentKeys (config.h). One GEMM pass: each
// (row, key) logit above the row's cut joins the row's candidates; after
// every segment of S = stream_segment_keys(topk) keys (S / 64 blocks, half
// of them each consumer's) both consumers stop between two blocks (the next
// one's WGMMAs in flight), and a row with more than kCandidates - S
// candidates is cut back to its topk best by its consumer
// (compact_candidates), which raises its cut. A later key has a larger index
// than every candidate, so it can join the topk only above the topk-th best
// candidate's order key; the cut is at most that. At the end each row's
// topk best candidates are its output, written in key order.
// ---------------------------------------------------------------------------
template <class Cfg>
struct StreamSink {
  int q_buffer = 0;
  uint64_t* q_free = nullptr;
  uint32_t first[kRows], span[kRows];  // each row's keys, from the CTA's first (span 0: the row takes none)
  uint32_t cut[kRows];                 // a key joins only above its row's cut
  uint32_t key_base;                   // the CTA's first key
  int segment_blocks, blocks;          // a checkpoint after each segment but the one the blocks end in
  uint32_t topk;
  int wg;                              // this consumer: it cuts back row wg
};

template <class Cfg, class Acc>
__device__ __forceinline__ void finish_block(typename Cfg::SharedMemoryPlan& plan, const Acc& acc,
                                             const ColumnWeights<Cfg>& weights, const KeyScales& k, int blk, int t,
                                             StreamSink<Cfg>& sink) {
  const LaneLogit l = lane_logit<Cfg>(acc, weights, k, t);
  const uint32_t pos = uint32_t(blk * kBlockKeys + l.m);
  const bool r1 = l.row != 0;  // (selects: a runtime index into the sink would put it in local memory)
  const bool take = pos - (r1 ? sink.first[1] : sink.first[0]) < (r1 ? sink.span[1] : sink.span[0]) &&
                    l.u > (r1 ? sink.cut[1] : sink.cut[0]);
  if (!__any_sync(0xffffffffu, take)) return;  // most blocks, once the cuts have risen
  const int lane = t % 32;
  auto& cand = Cfg::candidates(plan);
  append_candidate(cand.u[0], cand.key[0], &cand.count[0], take && !r1, l.u, sink.key_base + pos, lane);
  append_candidate(cand.u[1], cand.key[1], &cand.count[1], take && r1, l.u, sink.key_base + pos, lane);
}

// After this consumer's block blk: where blk ends a segment (the other
// consumer's last block of it is blk +- 1) and more blocks follow, the
// checkpoint.
template <class Cfg>
__device__ __forceinline__ void after_block(typename Cfg::SharedMemoryPlan& plan, StreamSink<Cfg>& sink, int blk,
                                            int t) {
  const int segment_end = (blk / sink.segment_blocks + 1) * sink.segment_blocks;
  if (blk + kConsumers < segment_end || segment_end >= sink.blocks) return;
  consumers_sync();  // both consumers' candidates of the segment appended
  auto& cand = Cfg::candidates(plan);
  const bool selects = (sink.wg ? sink.span[1] : sink.span[0]) != 0u;
  if (selects && cand.count[sink.wg] > uint32_t(kCandidates - sink.segment_blocks * kBlockKeys))
    compact_candidates(plan, cand, sink.wg, sink.topk, t);
  consumers_sync();  // both rows' cuts set
  sink.cut[0] = cand.cut[0];
  sink.cut[1] = cand.cut[1];
}

// One step of a warpgroup's block loop, two accumulators deep: block blk's
// WGMMAs are in flight in cur; the warpgroup's next block (blk + 2) is
// issued into next before blk's epilogue, so that its WGMMAs run under that
// epilogue. at: blk's ring position (its stage landed: issue_block waited
// for it). With an even number of stages the next block's stage wait runs
// under blk's WGMMAs too. With an odd number (3: one block of each
// warpgroup and one landing) blk's stage is freed first: the next block's
// stage is the one the other warpgroup frees, so waiting for it while
// holding blk's would let one load at a time land.
template <class Cfg, class TiledMma, class FragA, class FragB, class Acc, class Sink>
__device__ __forceinline__ void block_step(typename Cfg::SharedMemoryPlan& plan, TiledMma& mma, const FragA& tA,
                                           const FragB& tB, Acc& cur, Acc& next, const ColumnWeights<Cfg>& weights,
                                           float scale, int shift, KeyRingPos<Cfg> at, int blk, int t, Sink& sink) {
  const KeyScales k = stage_key_scales<Cfg>(plan, at, scale, shift, t);
  if constexpr (!Cfg::kSharedStages) {
    issue_block<Cfg>(plan, mma, tA, tB, next, at.advanced(), sink.q_buffer);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // blk's group has completed
    warpgroup_fence_operand(cur);
    release_stage<Cfg>(plan, at, t);
  } else {
    warpgroup_wait<0>();  // blk's group has completed
    warpgroup_fence_operand(cur);
    release_stage<Cfg>(plan, at, t);
    issue_block<Cfg>(plan, mma, tA, tB, next, at.advanced(), sink.q_buffer);
    warpgroup_commit_batch();
  }
  finish_block<Cfg>(plan, cur, weights, k, blk, t, sink);
  after_block<Cfg>(plan, sink, blk, t);
}

// The warpgroup's last block of a chunk: nothing behind it.
template <class Cfg, class Acc, class Sink>
__device__ __forceinline__ void block_last(typename Cfg::SharedMemoryPlan& plan, Acc& cur,
                                           const ColumnWeights<Cfg>& weights, float scale, int shift,
                                           KeyRingPos<Cfg> at, int blk, int t, Sink& sink) {
  const KeyScales k = stage_key_scales<Cfg>(plan, at, scale, shift, t);
  warpgroup_wait<0>();
  warpgroup_fence_operand(cur);
  if (sink.q_free != nullptr && t % 32 == 0) cutlass::arch::ClusterBarrier::arrive(sink.q_free);
  release_stage<Cfg>(plan, at, t);
  finish_block<Cfg>(plan, cur, weights, k, blk, t, sink);
  after_block<Cfg>(plan, sink, blk, t);  // (a segment may end here and the other consumer's last block follow)
}

// The blocks of one chunk: c.chunk_blocks(ch), whose scales start
// scale_shift(p, c, ch) into their stage slots.
struct ChunkBlocks {
  const CtaProblem& c;
  int ch;
  __device__ __forceinline__ int count() const { return c.chunk_blocks(ch); }
  __device__ __forceinline__ int shift(const IndexerTopkParams& p) const { return scale_shift(p, c, ch); }
};
// All the CTA's blocks in one run (the streaming selection).
struct AllBlocks {
  const CtaProblem& c;
  __device__ __forceinline__ int count() const { return int((c.end - c.begin + kBlockKeys - 1) / kBlockKeys); }
  __device__ __forceinline__ int shift(const IndexerTopkParams& p) const { return scale_shift(p, c, 0); }
};

// A warpgroup's blocks j0 + blk of a run (block j0 + blk is this
// warpgroup's where it is wg modulo 2: config.h, the key ring). The block in
// flight alternates between acc0 and acc1; the loop is unrolled by two so
// that each is named statically, and the last block finishes in whichever
// holds it.
template <class Cfg, class Blocks, class TiledMma, class FragA, class FragB, class Acc, class Sink>
__device__ __forceinline__ void block_logits(typename Cfg::SharedMemoryPlan& plan, const IndexerTopkParams& p,
                                             const Blocks& run, TiledMma& mma, const FragA& tA, const FragB& tB,
                                             Acc& acc0, Acc& acc1, const ColumnWeights<Cfg>& weights, int j0, int wg,
                                             int t, Sink& sink) {
  const int blocks = run.count();
  int blk = (wg + j0) & 1;
  if (blk >= blocks) {
    if (sink.q_free != nullptr && t % 32 == 0) cutlass::arch::ClusterBarrier::arrive(sink.q_free);
    return;
  }
  const int shift = run.shift(p);
  KeyRingPos<Cfg> at = KeyRingPos<Cfg>::of(j0 + blk);
  issue_block<Cfg>(plan, mma, tA, tB, acc0, at, sink.q_buffer);
  warpgroup_commit_batch();
  for (;;) {
    if (blk + kConsumers >= blocks) return block_last<Cfg>(plan, acc0, weights, p.scale, shift, at, blk, t, sink);
    block_step<Cfg>(plan, mma, tA, tB, acc0, acc1, weights, p.scale, shift, at, blk, t, sink);
    at = at.advanced();
    blk += kConsumers;
    if (blk + kConsumers >= blocks) return block_last<Cfg>(plan, acc1, weights, p.scale, shift, at, blk, t, sink);
    block_step<Cfg>(plan, mma, tA, tB, acc1, acc0, weights, p.scale, shift, at, blk, t, sink);
    at = at.advanced();
    blk += kConsumers;
  }
}

// A warpgroup's blocks of chunk ch.
template <class Cfg, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void chunk_logits(typename Cfg::SharedMemoryPlan& plan, const IndexerTopkParams& p,
                                             const CtaProblem& c, TiledMma& mma, const FragA& tA, const FragB& tB,
                                             Acc& acc0, Acc& acc1, const ColumnWeights<Cfg>& weights, int j0, int ch,
                                             int wg, int t, LogitsSink<Cfg> sink) {
  block_logits<Cfg>(plan, p, ChunkBlocks{c, ch}, mma, tA, tB, acc0, acc1, weights, j0, wg, t, sink);
}

template <class Cfg>
__device__ __forceinline__ void consume(typename Cfg::SharedMemoryPlan& plan, const IndexerTopkParams& p,
                                        const CtaProblem& c, int wg, int t) {
  const int lane = t % 32;
  const RowInfo me = wg == 0 ? c.rows[0] : c.rows[1];  // this warpgroup selects row wg
  int32_t* out = p.indices + me.row * p.topk;
  if (me.present && !me.select) write_all_keys(out, me.begin, me.span, p.topk, t);
  if (!c.any_select) return;
  for (int i = t; i < kHistBins; i += kWarpgroupThreads) plan.hist[wg][i] = 0u;

  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_slice(t);
  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Cfg::SmemLayoutQ{});  // (128, 64, dim tiles)
  Tensor sK = make_tensor(make_smem_ptr(plan.k), typename Cfg::SmemLayoutK{});  // (64, 64, stages x dim tiles)
  Tensor tA = thr_mma.partition_fragment_A(sK);
  Tensor tB = thr_mma.partition_fragment_B(sQ);
  // Two accumulators: a block's WGMMAs run under the previous block's epilogue.
  Tensor acc0 = partition_fragment_C(mma, Shape<Int<kBlockKeys>, Int<Cfg::kMmaN>>{});
  Tensor acc1 = partition_fragment_C(mma, Shape<Int<kBlockKeys>, Int<Cfg::kMmaN>>{});
  ColumnWeights<Cfg> weights;
  weights.load(p, c, lane);
  cutlass::arch::ClusterTransactionBarrier::wait(&plan.q_ready[0], 0);

  int j0 = 0;  // blocks of earlier chunks and passes (both warpgroups count alike)
  const uint32_t* u = plan.logits[0][wg];

  if (c.num_chunks == 1) {
    // Both warpgroups count both rows' first digits: every histogram cleared first.
    FirstDigit fd;
    fd.on = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      fd.first[r] = c.rows[r].begin - c.begin;
      fd.span[r] = c.rows[r].select ? c.rows[r].span : 0u;
    }
    consumers_sync();
    chunk_logits<Cfg>(plan, p, c, mma, tA, tB, acc0, acc1, weights, j0, 0, wg, t, LogitsSink<Cfg>{&plan.logits[0], fd});
    consumers_sync();  // both rows' logits stored and counted
    if (!me.select) return;
    const int a = int(me.begin - c.begin), e = a + int(me.span);
    RowSelect s = RowSelect::first_round(uint32_t(p.topk), me.span);
    hist_resolve(plan, s, wg, t);  // the first round's histogram is complete
    while (!s.done()) {
      hist_add(plan.hist[wg], u, a, e, s, t);
      hist_resolve(plan, s, wg, t);
    }
    EmitCursor cur;
    emit_keys(plan, u, a, e, c.begin, s, cur, out, p.topk, wg, t);
    return;
  }

  if (streams(p.topk)) {  // several chunks in one pass (StreamSink)
    StreamSink<Cfg> sink;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      sink.first[r] = c.rows[r].begin - c.begin;
      sink.span[r] = c.rows[r].select ? c.rows[r].span : 0u;
      sink.cut[r] = 0u;  // below every order key: take every key until a row's first cut
    }
    sink.key_base = c.begin;
    sink.segment_blocks = stream_segment_keys(p.topk) / kBlockKeys;
    sink.blocks = AllBlocks{c}.count();
    sink.topk = uint32_t(p.topk);
    sink.wg = wg;
    auto& cand = Cfg::candidates(plan);
    if (t == 0) cand.count[wg] = 0u, cand.cut[wg] = 0u;
    consumers_sync();  // both rows' counts and cuts set
    block_logits<Cfg>(plan, p, AllBlocks{c}, mma, tA, tB, acc0, acc1, weights, 0, wg, t, sink);
    consumers_sync();  // every candidate appended
    if (!me.select) return;
    if (cand.count[wg] > uint32_t(p.topk)) compact_candidates(plan, cand, wg, uint32_t(p.topk), t);
    emit_candidates_in_order(plan, cand, wg, me.begin, me.span, uint32_t(p.topk), out, t);
    return;
  }

  // Several chunks: a histogram pass per radix round, then the output pass.
  RowSelect s = RowSelect::first_round(uint32_t(p.topk), me.span);
  EmitCursor cur;
  bool emits = false;
  for (;;) {
    for (int ch = 0; ch < c.num_chunks; ++ch) {
      chunk_logits<Cfg>(plan, p, c, mma, tA, tB, acc0, acc1, weights, j0, ch, wg, t, LogitsSink<Cfg>{&plan.logits[0], {}});
      j0 += c.chunk_blocks(ch);  // blocks of earlier chunks and passes (both warpgroups count alike)
      consumers_sync();          // both rows' logits of the chunk stored
      const uint32_t cb = c.chunk_begin(ch), ce = cb + uint32_t(c.chunk_keys(ch));
      const uint32_t lo = max(me.begin, cb), hi = min(me.begin + me.span, ce);
      if (me.select && lo < hi && (emits || !s.done())) {
        if (emits) emit_keys(plan, u, int(lo - cb), int(hi - cb), cb, s, cur, out, p.topk, wg, t);
        else hist_add(plan.hist[wg], u, int(lo - cb), int(hi - cb), s, t);
      }
      consumers_sync();  // the row is read before the next chunk's logits overwrite it
    }
    if (emits) return;
    if (me.select && !s.done()) hist_resolve(plan, s, wg, t);
    if (t == 0) plan.row_done[wg] = !me.select || s.done();
    consumers_sync();
    emits = plan.row_done[0] && plan.row_done[1];
    if (wg == 0 && t == 0) plan.next_pass_emits = emits;
    consumers_sync();  // row_done is read before the next pass writes it
    asm volatile("bar.arrive %0, %1;" ::"n"(kBarPass), "n"(kPassThreads) : "memory");
  }
}

// ---------------------------------------------------------------------------
// The resident kernel (N <= kChunkKeys): one CTA per SM walks its pairs; the
// selector warpgroup selects a pair's rows while the consumers compute the
// next pair's logits. Every role walks the same pairs and counts the
// selecting ones (`used`) alike: selecting pair number `used` writes logits
// buffer used % 2, and Q's and each buffer's barrier phases follow from it.
// ---------------------------------------------------------------------------

// The CTA's pairs: round r takes pair r * G + b, or r * G + (G - 1 - b) in odd
// rounds, so that each CTA's pairs sum to about the same work (the pairs
// shorten along the order).
struct ResidentWalk {
  int round = 0;
  // (64-bit: past the last round it may pass INT32_MAX where the pairs come near it)
  __device__ __forceinline__ int64_t pair() const {
    const int64_t g = gridDim.x, b = blockIdx.x;
    return round * g + ((round & 1) ? g - 1 - b : b);
  }
};

// Walks the CTA's pairs: every(c) for each, then selecting(c, used) for each
// that selects (used: the selecting pairs before it), as every role counts them.
template <class Every, class Selecting>
__device__ __forceinline__ void walk_resident_pairs(const IndexerTopkParams& p, Every&& every, Selecting&& selecting) {
  const int pairs = num_pairs(p);
  int used = 0;
  for (ResidentWalk w; w.pair() < pairs; ++w.round) {
    const CtaProblem c = locate_pair(p, int(w.pair()));
    every(c);
    if (!c.any_select) continue;
    selecting(c, used);
    ++used;
  }
}
struct NoPairWork {
  __device__ __forceinline__ void operator()(const CtaProblem&) const {}
};

// Timeline events of the resident kernel's selecting pairs, one step each,
// in the order a CTA takes them (a timeline build only, common/timeline.cuh;
// tools/timeline.py reads these names). Roles 0 and 1: the consumers; role
// 2: the selector (the producer is not marked).
enum ResidentConsumerMark : int { kConsumerTop = 0, kLogitsFreeWaited, kQLanded, kLogitsStored };
enum SelectorMark : int {
  kSelectorTop = 0,     // before the wait for the pair's logits
  kLogitsFullWaited,
  kRow0FirstRound,      // row 0's first radix round resolved
  kRow0Rounds,          // its cut known
  kRow0Emitted,         // its output written
  kRow1FirstRound,
  kRow1Rounds,
  kRow1Emitted,
  kBufferFreed,
};
static_assert(kBufferFreed < timeline::kEvents, "a step's events fit the timeline's");

template <class Cfg>
__device__ __forceinline__ void produce_resident(typename Cfg::SharedMemoryPlan& plan, const IndexerTopkParams& p,
                                                 const TmaParams& tma) {
  int j = 0;
  walk_resident_pairs(p, NoPairWork{}, [&](const CtaProblem& c, int used) {
    if (used == 0) {  // (with N = 0 no pair selects, and the key map was never encoded)
      cute::prefetch_tma_descriptor(&tma.q);
      cute::prefetch_tma_descriptor(&tma.k);
      cute::prefetch_tma_descriptor(&tma.k_scale);
    }
    // The pair's Q once both consumers' WGMMAs of the pair kQBuffers before
    // are done. With one Q buffer that is the previous pair: its Q goes to L2
    // first, and the stages the previous pair's last blocks free take the
    // pair's first blocks before the wait.
    const int qb = used % Cfg::kQBuffers;
    const int blocks = c.chunk_blocks(0);
    int blk = 0;
    if constexpr (Cfg::kQBuffers == 1) {
      prefetch_q<Cfg>(tma, c);
      for (; blk < min(blocks, Cfg::kStages - 1); ++blk, ++j)
        load_block<Cfg>(plan, tma, c, p.s_kv, int(c.begin) + blk * kBlockKeys, j);
    }
    cutlass::arch::ClusterBarrier::wait(&plan.q_free[qb], uint32_t((used / Cfg::kQBuffers) & 1) ^ 1u);
    load_q<Cfg>(plan, tma, c, qb);
    for (; blk < blocks; ++blk, ++j) load_block<Cfg>(plan, tma, c, p.s_kv, int(c.begin) + blk * kBlockKeys, j);
  });
}

template <class Cfg>
__device__ __forceinline__ void consume_resident(typename Cfg::SharedMemoryPlan& plan, const IndexerTopkParams& p,
                                                 int wg, int t) {
  const int lane = t % 32;
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_slice(t);
  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(plan.k), typename Cfg::SmemLayoutK{});
  Tensor tA = thr_mma.partition_fragment_A(sK);
  Tensor tB = thr_mma.partition_fragment_B(sQ);
  Tensor acc0 = partition_fragment_C(mma, Shape<Int<kBlockKeys>, Int<Cfg::kMmaN>>{});
  Tensor acc1 = partition_fragment_C(mma, Shape<Int<kBlockKeys>, Int<Cfg::kMmaN>>{});
  int j0 = 0;
  walk_resident_pairs(p, NoPairWork{}, [&](const CtaProblem& c, int used) {
    auto mark = [&](int event) { timeline::mark(t == 0, wg, used, event); };
    mark(kConsumerTop);
    ColumnWeights<Cfg> weights;
    weights.load(p, c, lane);
    const int b = used & 1, qb = used % Cfg::kQBuffers;
    cutlass::arch::ClusterBarrier::wait(&plan.logits_free[b], uint32_t((used >> 1) & 1) ^ 1u);
    mark(kLogitsFreeWaited);
    cutlass::arch::ClusterTransactionBarrier::wait(&plan.q_ready[qb], uint32_t((used / Cfg::kQBuffers) & 1));
    mark(kQLanded);
    chunk_logits<Cfg>(plan, p, c, mma, tA, tB, acc0, acc1, weights, j0, 0, wg, t,
                      LogitsSink<Cfg>{&plan.logits[b], {}, qb, &plan.q_free[qb]});
    mark(kLogitsStored);
    j0 += c.chunk_blocks(0);
    cutlass::arch::ClusterBarrier::arrive(&plan.logits_full[b]);  // this thread's logits stored
  });
}

// The selector warpgroup: every row's output (rows with at most topk keys
// written directly), selecting rows from their pair's logits buffer.
template <class Cfg>
__device__ __forceinline__ void select_resident(typename Cfg::SharedMemoryPlan& plan, const IndexerTopkParams& p,
                                                int t) {
  for (int i = t; i < kHistBins; i += kWarpgroupThreads) plan.hist[0][i] = 0u;
  row_sync(0);
  const auto write_unselected_rows = [&](const CtaProblem& c) {
    for (int r = 0; r < kRows; ++r) {
      const RowInfo& ri = c.rows[r];
      if (ri.present && !ri.select) write_all_keys(p.indices + ri.row * p.topk, ri.begin, ri.span, p.topk, t);
    }
  };
  walk_resident_pairs(p, write_unselected_rows, [&](const CtaProblem& c, int used) {
    auto mark = [&](int event) { timeline::mark(t == 0, 2, used, event); };
    mark(kSelectorTop);
    const int b = used & 1;
    cutlass::arch::ClusterBarrier::wait(&plan.logits_full[b], uint32_t((used >> 1) & 1));
    mark(kLogitsFullWaited);
    for (int r = 0; r < kRows; ++r) {
      const RowInfo ri = r == 0 ? c.rows[0] : c.rows[1];  // (a select: a runtime index would put c in local memory)
      if (!ri.select) continue;
      const int row_mark = r * (kRow1FirstRound - kRow0FirstRound);
      const uint32_t* u = plan.logits[b][r];
      const int a = int(ri.begin - c.begin), e = a + int(ri.span);
      RowSelect s = RowSelect::first_round(uint32_t(p.topk), ri.span);
      for (bool first = true; !s.done(); first = false) {
        hist_add(plan.hist[0], u, a, e, s, t);
        hist_resolve(plan, s, 0, t);
        if (first) mark(kRow0FirstRound + row_mark);
      }
      mark(kRow0Rounds + row_mark);
      EmitCursor cur;
      emit_keys(plan, u, a, e, c.begin, s, cur, p.indices + ri.row * p.topk, p.topk, 0, t);
      mark(kRow0Emitted + row_mark);
    }
    row_sync(0);  // every read of the buffer done
    if (t == 0) cutlass::arch::ClusterBarrier::arrive(&plan.logits_free[b]);
    mark(kBufferFreed);
  });
}

template <class Cfg>
__global__ void __launch_bounds__(kResidentThreads, 1)
    indexer_topk_resident_kernel(const __grid_constant__ IndexerTopkParams params,
                                 const __grid_constant__ TmaParams tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(Cfg::kResident, "the resident kernel takes the resident plan");
  extern __shared__ char smem_raw[];
  using Plan = typename Cfg::SharedMemoryPlan;
  Plan& plan = aligned_plan<Plan>(smem_raw);
  if (threadIdx.x == 0) {
    init_ring_and_q<Cfg>(plan);
    for (int i = 0; i < Cfg::kQBuffers; ++i)
      cutlass::arch::ClusterBarrier::init(&plan.q_free[i], kConsumers * 4);  // every consumer warp
    for (int i = 0; i < Cfg::kLogitBuffers; ++i) {
      cutlass::arch::ClusterBarrier::init(&plan.logits_full[i], kConsumers * kWarpgroupThreads);
      cutlass::arch::ClusterBarrier::init(&plan.logits_free[i], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  timeline::mark_start();
  const int wg = int(threadIdx.x) / kWarpgroupThreads;
  const int t = int(threadIdx.x) % kWarpgroupThreads;
  if (wg == kConsumers) {
    cutlass::arch::warpgroup_reg_dealloc<kResidentProducerRegs>();
    if (t == 0) produce_resident<Cfg>(plan, params, tma);
  } else if (wg == kConsumers + 1) {
    cutlass::arch::warpgroup_reg_dealloc<kResidentSelectorRegs>();
    select_resident<Cfg>(plan, params, t);
    timeline::mark_end(t == 0, 2);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kResidentConsumerRegs>();
    consume_resident<Cfg>(plan, params, wg, t);
    timeline::mark_end(t == 0, wg);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built without WGMMA: fail loudly rather than leave the output unwritten
#endif
}

// ---------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------
template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    indexer_topk_kernel(const __grid_constant__ IndexerTopkParams params, const __grid_constant__ TmaParams tma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  using Plan = typename Cfg::SharedMemoryPlan;
  Plan& plan = aligned_plan<Plan>(smem_raw);
  if (threadIdx.x == 0) {
    init_ring_and_q<Cfg>(plan);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const CtaProblem cta = locate_pair(params, int(blockIdx.x));
  const int wg = int(threadIdx.x) / kWarpgroupThreads;
  const int t = int(threadIdx.x) % kWarpgroupThreads;
  if (wg == kConsumers) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (t < 32) produce<Cfg>(plan, params, tma, cta, t);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume<Cfg>(plan, params, cta, wg, t);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built without WGMMA: fail loudly rather than leave the output unwritten
#endif
}

// ---------------------------------------------------------------------------
// Host launcher for one (DI, HI) variant.
// ---------------------------------------------------------------------------
template <class Cfg>
LaunchStatus run_variant(const IndexerTopkParams& p, cudaStream_t stream, const char** detail) {
  if (p.batch < 1 || p.s_q < 1 || p.topk < 1 || p.h_idx < 1 || p.h_idx > Cfg::HT || p.d_idx != Cfg::DI ||
      p.s_kv < 0 || p.k_stride < 1) {
    *detail = "empty or invalid problem (B, S, topk >= 1, 1 <= HI <= the variant's heads): nothing to launch";
    return LaunchStatus::kInvalidProblem;
  }
  TmaParams tma{};
  constexpr int kElemBytes = int(sizeof(typename Cfg::Elem));
  if (LaunchStatus s = encode_head_tile_map(&tma.q, p.index_q, Cfg::DI, p.h_idx, p.s_q, p.batch, Cfg::HT, detail,
                                            kRows, kElemBytes);
      s != LaunchStatus::kOk)
    return s;
  if (p.s_kv > 0) {  // N = 0: every row is all -1 and no key is read
    const uint64_t dims[3] = {uint64_t(Cfg::DI), uint64_t(p.s_kv), uint64_t(p.batch)};
    const uint64_t strides[2] = {uint64_t(Cfg::DI) * kElemBytes, uint64_t(Cfg::DI) * kElemBytes * uint64_t(p.s_kv)};
    const uint32_t box[3] = {uint32_t(Cfg::kTile), uint32_t(kBlockKeys), 1u};
    const uint32_t elem_strides[3] = {1, 1, 1};
    const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        &tma.k, tensor_map_type(kElemBytes), 3, const_cast<void*>(p.index_k), dims, strides, box, elem_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      *detail = "cuTensorMapEncodeTiled failed for the index_k map";
      return LaunchStatus::kTensorMapError;
    }
    // index_k_scale flat over (B, N): a block's scales from (batch * N + key0) & ~3
    // (an int32 coordinate: index_k alone would be past 256 GiB before this fails).
    if (int64_t(p.batch) * p.s_kv + kBlockKeys > int64_t(INT32_MAX)) {
      *detail = "B * N must be below 2^31 - 64 (the index_k_scale map's coordinates)";
      return LaunchStatus::kInvalidProblem;
    }
    const uint64_t scale_dims[1] = {uint64_t(p.batch) * uint64_t(p.s_kv)};
    const uint64_t scale_strides[1] = {0};  // (rank 1: none is read)
    const uint32_t scale_box[1] = {uint32_t(Cfg::kScaleWords)};
    const CUresult rs = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        &tma.k_scale, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, const_cast<float*>(p.index_k_scale), scale_dims,
        scale_strides, scale_box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
        CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (rs != CUDA_SUCCESS) {
      *detail = "cuTensorMapEncodeTiled failed for the index_k_scale map (its address must be 16-byte aligned)";
      return LaunchStatus::kTensorMapError;
    }
  }
  const int64_t pairs = int64_t(p.batch) * ((int64_t(p.s_q) + 1) / 2);
  // Every pair's keys fit one chunk and some SM gets more than one pair: one
  // resident CTA per SM, selecting beside the next pair's logits. With a
  // pair per SM there is nothing to overlap; the multi-pass kernel selects a
  // pair's two rows side by side.
  const int sms = device_sm_count();  // 0 if the query failed: the multi-pass kernel
  if (p.s_kv <= kChunkKeys && sms > 0 && pairs > sms) {
    using Resident = Config<Cfg::DI, Cfg::HT, typename Cfg::Elem, true>;
    const timeline::Recorder timeline(stream);
    const LaunchStatus status = launch_kernel(&indexer_topk_resident_kernel<Resident>, int64_t(sms), kResidentThreads,
                                              Resident::kSmemBytes, stream, detail, p, tma);
    timeline.write(stream);
    return status;
  }
  return launch_kernel(&indexer_topk_kernel<Cfg>, pairs, kThreads, Cfg::kSmemBytes, stream, detail, p, tma);
}

}  // namespace indexer_topk
}  // namespace attn_dist

// Explicit instantiation: CMake generates one file with this line per entry of
// jax_attn_dist/ops/indexer_topk/variants.py, compiled up to four to a unit;
// each (DI, HI) variant is built for both element types.
#define INDEXER_TOPK_INSTANTIATE(DI, HI)                                                                   \
  template attn_dist::LaunchStatus                                                                         \
  attn_dist::indexer_topk::run_variant<attn_dist::indexer_topk::Config<DI, HI, attn_dist::bf16>>(         \
      const attn_dist::IndexerTopkParams&, cudaStream_t, const char**);                                    \
  template attn_dist::LaunchStatus                                                                         \
  attn_dist::indexer_topk::run_variant<attn_dist::indexer_topk::Config<DI, HI, attn_dist::indexer_topk::fp8>>( \
      const attn_dist::IndexerTopkParams&, cudaStream_t, const char**);
