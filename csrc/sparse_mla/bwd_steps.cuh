// The sparse MLA backward's consumer steps (the loops that call them:
// bwd_kernel.cuh): the row terms, the WGMMAs of S, dP, dQ and dKV, P and dS
// through shared memory, and the dKV tiles' reductions into the kv gradient.
#pragma once

#include <cfloat>
#include <cstdint>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/cluster.cuh"
#include "../common/cta.cuh"
#include "../common/fixed_point.cuh"
#include "../common/gather.cuh"
#include "bwd_config.h"
#include "row.cuh"
#include "scores.cuh"

namespace attn_dist {
namespace sparse_mla {

using namespace cute;
using cutlass::arch::NamedBarrier;

// ---------------------------------------------------------------------------
// Consumer steps. Accumulator layout (64 x N, f32): thread (warp w, lane l)
// holds rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1); acc(4j + 2*rh + e)
// is row 16w + l/4 + 8rh, column 8j + 2(l%4) + e.
// ---------------------------------------------------------------------------

__device__ __forceinline__ int acc_row(int thread, int rh) { return 16 * (thread / 32) + (thread % 32) / 4 + 8 * rh; }

// This thread's two heads' values of a per-(token, head) array [B, S, H]
// (lse, the row terms); `past_h` for a head past H.
template <class Cfg>
__device__ __forceinline__ void load_head_values(const float* values, const SparseMlaBwdParams& p,
                                                 const CtaProblem& c, int thread, float past_h, float (&out)[2]) {
  const int64_t token = int64_t(c.batch) * p.s_q + c.s;
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const int head = c.head_tile * Cfg::HT + acc_row(thread, rh);
    out[rh] = head < p.h_q ? __ldg(values + token * p.h_q + head) : past_h;
  }
}

// This thread's two heads' lse in base 2, +inf where the head takes no
// probability (a non-finite lse, or a head past H): scores_to_p gives those
// heads P = 0, whatever their scores hold.
template <class Cfg>
__device__ __forceinline__ void load_lse2(const SparseMlaBwdParams& p, const CtaProblem& c, int thread,
                                          float (&lse2)[2]) {
  load_head_values<Cfg>(p.lse, p, c, thread, -INFINITY, lse2);
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const float l = p.lse_base_e ? lse2[rh] * 1.4426950408889634f : lse2[rh];  // log2(e)
    lse2[rh] = fabsf(l) <= FLT_MAX ? l : INFINITY;
  }
}

// acc = A.K^T over A's dim tiles of the block (A: Q, all D, or dO, the values; whose
// tiles land by TMA before the first block), from kFirstTile on, wrapping;
// issued and committed, not waited for.
template <class Cfg, class LayoutA, int kFirstTile = 0, class Acc, class OnLanded = timeline::NoMark>
__device__ __forceinline__ void issue_scores(typename Cfg::SharedMemoryPlan& plan, const bf16* a_smem,
                                             uint64_t* a_ready, uint32_t phase, bool first_block, Acc& acc,
                                             int thread, OnLanded on_landed = {}) {
  issue_block_scores<typename Cfg::MmaScores, LayoutA, typename Cfg::Ring::SmemLayout, kFirstTile>(
      a_smem, a_ready, plan.kv, plan.ring.full[0], phase, first_block, acc, thread, on_landed);
}

// S -> P in place: exp2(S scale_log2 - lse2) on valid slots of heads with a
// finite lse, 0 elsewhere (also where S is not finite: the jnp path's masks).
template <class Acc>
__device__ __forceinline__ void scores_to_p(Acc& acc, uint64_t valid, float scale_log2, const float (&lse2)[2],
                                            int lane) {
  for_each_acc_element(lane, [&](int i, int rh, int col) {
    acc(i) = (valid >> col) & 1 && lse2[rh] != INFINITY ? fast_exp2(acc(i) * scale_log2 - lse2[rh]) : 0.f;
  });
}

// dP -> dS in place from P (read back from its shared tile, where this
// thread's WG0 twin wrote the same positions): P (dP - delta) sm_scale; 0
// where P is 0, whatever dP holds.
template <class Cfg, class Acc>
__device__ __forceinline__ void dp_to_ds(typename Cfg::SharedMemoryPlan& plan, Acc& acc, const float (&delta)[2],
                                         float sm_scale, int thread) {
  Tensor sP = make_tensor(make_smem_ptr(plan.p), typename Cfg::SmemLayoutTile{});
  const int lane = thread % 32;
  CUTE_UNROLL
  for (int j = 0; j < kBlockTopk / 8; ++j)
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int i = 4 * j + 2 * rh;
      __nv_bfloat162 p2;
      cutlass::arch::shared_load<4>(&p2, cute::cast_smem_ptr_to_uint(&sP(acc_row(thread, rh), 8 * j + 2 * (lane % 4))));
      const float2 pr = __bfloat1622float2(p2);
      acc(i) = pr.x > 0.f ? pr.x * (acc(i) - delta[rh]) * sm_scale : 0.f;
      acc(i + 1) = pr.y > 0.f ? pr.y * (acc(i + 1) - delta[rh]) * sm_scale : 0.f;
    }
}

// A 64 x 64 accumulator as bf16 into a shared tile (a WGMMA operand), then
// fenced for the async proxy that the WGMMAs read it through.
template <class Acc>
__device__ __forceinline__ void store_tile(bf16* tile, const Acc& acc, int thread) {
  store_acc_tile(tile, acc, acc_row(thread, 0), thread % 32);  // a SmemLayoutTile tile
  cutlass::arch::fence_view_async_shared();
}

// dQ[:, the dims of the stages from first_tile] += dS.K (issued, not
// committed): Mma MmaDq4 with LayoutK SmemLayoutK4T (four value tiles), or
// MmaDq1 with SmemLayoutTileT (the rope tile).
template <class Cfg, class Mma, class LayoutK, class Acc>
__device__ __forceinline__ void issue_dq(typename Cfg::SharedMemoryPlan& plan, int first_tile, Acc& acc,
                                         int thread) {
  Mma mma;
  auto thr = mma.get_slice(thread);
  Tensor sDs = make_tensor(make_smem_ptr(plan.ds), typename Cfg::SmemLayoutTile{});
  Tensor sK = make_tensor(make_smem_ptr(plan.kv + first_tile * Cfg::kTileElems), LayoutK{});
  Tensor tA = thr.partition_fragment_A(sDs);
  Tensor tB = thr.partition_fragment_B(sK);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tA); ++kb) cute::gemm(mma, tA(_, _, kb), tB(_, _, kb), acc);
  warpgroup_fence_operand(acc);
}

// acc = dS^T.Q[:, tile] (+ P^T.dO[:, tile] for a value tile): the block's
// kv gradient, 64 keys x 64 dims. Issued and committed. (Whether the tile
// holds values is a template parameter: a branch between the WGMMAs would
// make ptxas fence the accumulator.)
template <class Cfg, bool kValueTile, class Acc>
__device__ __forceinline__ void issue_dkv_tile(typename Cfg::SharedMemoryPlan& plan, int tile, Acc& acc,
                                               int thread) {
  typename Cfg::MmaDkv mma;
  auto thr = mma.get_slice(thread);
  using LayoutT = typename Cfg::SmemLayoutTileT;
  Tensor tDs = thr.partition_fragment_A(make_tensor(make_smem_ptr(plan.ds), LayoutT{}));
  Tensor tQ = thr.partition_fragment_B(make_tensor(make_smem_ptr(plan.q + tile * Cfg::kTileElems), LayoutT{}));
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tDs); ++kb) {
    mma.accumulate_ = kb == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    cute::gemm(mma, tDs(_, _, kb), tQ(_, _, kb), acc);
  }
  if constexpr (kValueTile) {
    Tensor tP = thr.partition_fragment_A(make_tensor(make_smem_ptr(plan.p), LayoutT{}));
    Tensor tDo =
        thr.partition_fragment_B(make_tensor(make_smem_ptr(plan.dout + tile * Cfg::kTileElems), LayoutT{}));
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tP); ++kb) cute::gemm(mma, tP(_, _, kb), tDo(_, _, kb), acc);
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

// Where this thread's two dKV rows (slots) go: the element offset of the
// key's gradient row, or -1 for an invalid slot (nothing is added).
struct KeyRows {
  int64_t offset[2];
};

template <class Cfg>
__device__ __forceinline__ KeyRows block_key_rows(const SparseMlaBwdParams& p, const CtaProblem& c, int block,
                                                  int thread) {
  KeyRows k;
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const int32_t i = c.slots.load(block * kBlockTopk + acc_row(thread, rh));
    k.offset[rh] = c.slots.valid(i) ? (int64_t(c.batch) * p.s_kv + i) * Cfg::D : -1;
  }
  return k;
}

// The deterministic mode's view of its batch element's scale words: 2^F,
// and the largest bound of any row, which no term may exceed (a term past it
// means an lse that is not the forward's: flagged, dkv NaN, rather than a
// silent overflow).
struct FixedTerms {
  float two_to_f = 0.f;
  float term_limit = 0.f;
  unsigned* flag = nullptr;
};

// Two floats as a bf16 pair (round to nearest even), the first in the low half.
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void red_add_f32x4(float* dst, const float4& v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

// The float32 kv gradient keeps each group of 16 columns in the dKV
// accumulator's order while it is reduced into (undone by
// launch_dkv_columns_in_order): a quad's lane r holds columns 2r, 2r + 1,
// 8 + 2r and 9 + 2r of a row in a group, stored at 4r .. 4r + 3, so its four
// values are one 16-byte vector and a quad's four vectors 64 contiguous bytes
// of the row. In column order a quad's pairs covered 32 bytes, and the L2 saw
// one request per 32-byte sector (ncu). (Quads swapping a vector per line so
// that each warp instruction adds whole 128-byte lines measured the same.)
__device__ __forceinline__ int accumulator_order_column(int group, int lane) { return 16 * group + 4 * (lane % 4); }

template <class Acc>
__device__ __forceinline__ float4 group_vector(const Acc& acc, int group, int rh) {
  const int i = 8 * group + 2 * rh;  // accumulator column groups 2 group (i) and 2 group + 1 (i + 4)
  return make_float4(acc(i), acc(i + 1), acc(i + 4), acc(i + 5));
}

// Adds column groups [kFirst, kFirst + kCount) (8 columns each) of a dKV
// tile into the kv gradient: float32 atomics (above), or (deterministic)
// 64-bit fixed-point integer atomics, exact in any order, in column order.
template <class Cfg, int kFirst, int kCount, class Acc>
__device__ __forceinline__ void reduce_dkv_tile(const SparseMlaBwdParams& p, const Acc& acc, const KeyRows& rows,
                                                int tile, const FixedTerms& fixed, int lane) {
  if constexpr (!Cfg::kDeterministic) {
    static_assert(kFirst % 2 == 0 && kCount % 2 == 0, "whole 16-column groups");
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      if (rows.offset[rh] < 0) continue;
      float* dst = p.dkv + rows.offset[rh] + tile * kDimTile;
      CUTE_UNROLL
      for (int g = kFirst / 2; g < (kFirst + kCount) / 2; ++g)
        red_add_f32x4(dst + accumulator_order_column(g, lane), group_vector(acc, g, rh));
    }
  } else {
    // A quad's four lanes hold 16 columns of a row as pairs (2r, 2r + 1 of
    // each 8-column group); each term goes to the lane that adds it so that
    // a quad's instruction adds columns 4k .. 4k + 3: one whole 32-byte
    // sector, where a pair's two atomics spread each over two sectors.
    static_assert(kFirst % 2 == 0 && kCount % 2 == 0, "whole 16-column groups");
    const int r = lane % 4;
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int64_t row_at = rows.offset[rh] + tile * kDimTile + r;  // used only for a valid key
      CUTE_UNROLL
      for (int g = kFirst / 2; g < (kFirst + kCount) / 2; ++g) {
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) {  // column 16 g + 4 k + r: element r % 2 of lane 2 (k % 2) + r / 2's pair
          const int j = 2 * g + k / 2;
          const int from = (lane & ~3) | (2 * (k % 2) + r / 2);
          const float lo = __shfl_sync(0xffffffffu, acc(4 * j + 2 * rh), from);
          const float hi = __shfl_sync(0xffffffffu, acc(4 * j + 2 * rh + 1), from);
          const float x = r % 2 ? hi : lo;
          if (rows.offset[rh] < 0) continue;
          if (!(fabsf(x) <= fixed.term_limit)) flag_non_finite(fixed.flag);
          atomicAdd(reinterpret_cast<unsigned long long*>(p.dkv_fixed + row_at + 16 * g + 4 * k),
                    static_cast<unsigned long long>(to_fixed(x, fixed.two_to_f)));
        }
      }
    }
  }
}

// Stages [first, first + n) of the block have been read by this warpgroup.
template <class Cfg>
__device__ __forceinline__ void release_stages(typename Cfg::SharedMemoryPlan& plan, int first, int n, int lane) {
  for (int i = 0; i < n; ++i) release_stage<typename Cfg::Ring>(plan.ring, 0, first + i, lane);
}

// A consumer warpgroup's part in its head-tile pair's dKV merge
// (bwd_config.h). `send_phase` and `recv_phase` are the parities of its next
// waits on send_free[warpgroup] and recv_full[warpgroup]. Whether there is
// a pair is the kernel's template flag, so that every branch on it is
// resolved at compile time and each kernel holds only its own merge.
template <bool kPaired>
struct PairRole {
  int warpgroup = 0;
  uint32_t rank = 0, partner = 0;  // this CTA's and the other CTA's ranks in the cluster
  uint32_t send_phase = 0, recv_phase = 0;
};

template <bool kPaired>
__device__ __forceinline__ PairRole<kPaired> pair_role(int warpgroup) {
  PairRole<kPaired> r;
  r.warpgroup = warpgroup;
  if constexpr (kPaired) {
    r.rank = cute::block_rank_in_cluster();
    r.partner = r.rank ^ 1u;
  }
  return r;
}

// The value stages kDqTilesPerConsumer.. that a consumer releases once its
// last reader there is done (WG0 after the scores, WG1 after dQ); in a pair,
// all but its own landing, which it keeps until its merges of the block are done.
template <class Cfg, bool kPaired>
__device__ __forceinline__ void release_dq_stages(typename Cfg::SharedMemoryPlan& plan,
                                                  const PairRole<kPaired>& role, int lane) {
  for (int stage = bwd::kDqTilesPerConsumer; stage < bwd::kValueTiles; ++stage)
    if (!kPaired || stage != bwd::kLandingStage + role.warpgroup)
      release_stage<typename Cfg::Ring>(plan.ring, 0, stage, lane);
}

// Warpgroup w's landing: 16-byte word i of thread t (its accumulator
// elements of column groups 2i and 2i + 1 of the half, as bf16 pairs) at
// word i * 128 + t, so that a warp's accesses fill whole bank rows. Both
// CTAs' threads hold the same elements of a tile.
template <class Cfg>
__device__ __forceinline__ uint4* landing_of_thread(typename Cfg::SharedMemoryPlan& plan, int warpgroup,
                                                    int thread) {
  return reinterpret_cast<uint4*>(plan.kv + (bwd::kLandingStage + warpgroup) * Cfg::Ring::kStageElems) + thread;
}

// After the block's dQ (this warpgroup's WGMMAs read no key stage any more):
// once both consumers have said so, the partner may send its first half tiles
// of the block into this CTA's landings.
template <bool kPaired>
__device__ __forceinline__ void landing_free_after_dq(uint64_t* send_free, const PairRole<kPaired>& role, int lane) {
  if constexpr (!kPaired) return;
  __syncwarp();
  if (lane == 0)
    for (int w = 0; w < bwd::kNumConsumers; ++w)
      arrive_cluster_relaxed(cluster_address(&send_free[w], role.partner), 1);
}

// Deterministic: a pair's merged half tile goes into the fixed-point sums
// from a warp's own rows: 8 of its 16 rows at a time (its rh = 0 or 1 rows),
// 16 columns of each (pass 0 or 1), staged as 128-byte rows in the warp's
// kilobyte of its landing's upper half (the partner's bf16 half tile fills
// the lower half), then added by 64-bit integer reductions, each warp
// instruction two rows' whole 128-byte lines. Only the warp touches its
// rows, so no warpgroup barrier and no copy-engine wait sits in the merge.
constexpr int kStagedRowBytes = 128;
constexpr int kWarpStagedRows = 8;
constexpr int kWarpStagingBytes = kWarpStagedRows * kStagedRowBytes;
static_assert(kStagedRowBytes == bwd::kPairDimsPerRank / 2 * int(sizeof(long long)) &&
                  bwd::kHalfTileBytes + kWarpgroupThreads / 32 * kWarpStagingBytes <= bwd::kLandingBytes,
              "a warp's staged rows (16 fixed-point columns) fit beside the landed half tile");

// Row lane / 4 (of the warp's rh rows) gets this lane's four terms: columns
// 2r, 2r + 1 (16-byte chunk r) and 8 + 2r, 9 + 2r (chunk 4 + r) of 16-column
// group kFirstGroup + pass, r = lane % 4; odd rows swap their chunk halves,
// so that each quarter warp's 16-byte stores cover 32 banks.
__device__ __forceinline__ int staged_chunk(int row, int chunk) { return chunk ^ (4 * (row & 1)); }

template <int kFirstGroup, class Acc>
__device__ __forceinline__ void stage_fixed_warp_rows(char* staging, const Acc& acc, const KeyRows& rows, int pass,
                                                      int rh, const FixedTerms& fixed, int lane) {
  const int g = kFirstGroup + pass;
  const int row = lane / 4;
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const float x0 = acc(8 * g + 4 * half + 2 * rh), x1 = acc(8 * g + 4 * half + 2 * rh + 1);
    // An invalid slot's row is staged but never added: its terms are no terms (as unpaired).
    if (rows.offset[rh] >= 0 && !(fabsf(x0) <= fixed.term_limit && fabsf(x1) <= fixed.term_limit))
      flag_non_finite(fixed.flag);
    *reinterpret_cast<longlong2*>(staging + row * kStagedRowBytes + staged_chunk(row, 4 * half + lane % 4) * 16) =
        make_longlong2(to_fixed(x0, fixed.two_to_f), to_fixed(x1, fixed.two_to_f));
  }
}

// The warp's staged rows added into the fixed-point sums: lanes 0-15 take
// row 2k's 16 columns, lanes 16-31 row 2k + 1's; a row's key offset comes
// from the first lane of the quad that holds it.
template <int kRank>
__device__ __forceinline__ void reduce_fixed_warp_rows(const SparseMlaBwdParams& p, const char* staging,
                                                       int64_t offset, int tile, int pass, int lane) {
  const int col = lane % 16;
  CUTE_UNROLL
  for (int k = 0; k < kWarpStagedRows / 2; ++k) {
    const int row = 2 * k + lane / 16;
    const long long key = __shfl_sync(0xffffffffu, static_cast<long long>(offset), 4 * row);
    const long long v = *reinterpret_cast<const long long*>(staging + row * kStagedRowBytes +
                                                            staged_chunk(row, col / 2) * 16 + (col % 2) * 8);
    if (key >= 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(p.dkv_fixed + key + tile * kDimTile +
                                                      kRank * bwd::kPairDimsPerRank + pass * 16 + col),
                static_cast<unsigned long long>(v));
  }
}

// A landing given back: to the partner for its next half, or after the
// block's last tile to the gather.
template <class Cfg>
__device__ __forceinline__ void free_landing(typename Cfg::SharedMemoryPlan& plan, const PairRole<true>& role,
                                             bool last_of_block, int lane) {
  const int w = role.warpgroup;
  if (!last_of_block) {
    if (lane == 0) arrive_cluster_relaxed(cluster_address(&plan.send_free[w], role.partner), 2);
  } else {
    release_stage<typename Cfg::Ring>(plan.ring, 0, bwd::kLandingStage + w, lane);
  }
}

// The steps of a dKV tile's merge that the timeline build marks: its product
// completed (dkv_tiles), the partner's landing free, the partner's half received.
enum MergeStep : int { kMergeProductDone, kMergeLandingFree, kMergeReceived, kMergeSteps };

// A pair's merge of a waited dKV tile, rank kRank's side: the partner's column
// half of this warpgroup's partial goes into the partner's landing (st.async,
// once the partner has freed it), as bf16; the partner's partial of this
// rank's half is awaited, widened and added. Float32: the landing freed
// first, then the vector atomics, whose issue can stall on L2; deterministic: the fixed-point terms
// staged warp by warp in the landing's upper half and reduced from there
// (above), the landing freed once they are read. (Freed for the partner's next half, or, after
// the block's last tile, for the gather of the next block.)
// on_step(kMergeLandingFree) and on_step(kMergeReceived) follow its two
// waits on the partner.
template <class Cfg, int kRank, class Acc, class OnStep>
__device__ __forceinline__ void merge_dkv_tile(typename Cfg::SharedMemoryPlan& plan, const SparseMlaBwdParams& p,
                                               Acc& acc, const KeyRows& rows, int tile, const FixedTerms& fixed,
                                               PairRole<true>& role, bool last_of_block, int thread, OnStep on_step) {
  constexpr int kGroups = bwd::kPairDimsPerRank / 8;
  constexpr int kKeep = kRank * kGroups, kSend = (1 - kRank) * kGroups;
  const int lane = thread % 32;
  const int w = role.warpgroup;
  wait_cluster_relaxed(&plan.send_free[w], role.send_phase);
  role.send_phase ^= 1u;
  on_step(kMergeLandingFree);
  const uint32_t dst = cluster_address(landing_of_thread<Cfg>(plan, w, thread), role.partner);
  const uint32_t full = cluster_address(&plan.recv_full[w], role.partner);
  // As bf16 pairs (why: bwd_config.h, head-tile pairs).
  CUTE_UNROLL
  for (int i = 0; i < kGroups; i += 2) {
    const int j = kSend + i;
    store_async_cluster_b32x4(dst + uint32_t(i / 2 * kWarpgroupThreads) * 16u, bf16x2_bits(acc(4 * j), acc(4 * j + 1)),
                              bf16x2_bits(acc(4 * j + 2), acc(4 * j + 3)), bf16x2_bits(acc(4 * j + 4), acc(4 * j + 5)),
                              bf16x2_bits(acc(4 * j + 6), acc(4 * j + 7)), full);
  }
  if (thread == 0)
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&plan.recv_full[w], bwd::kHalfTileBytes);
  wait_cluster(&plan.recv_full[w], role.recv_phase);
  role.recv_phase ^= 1u;
  on_step(kMergeReceived);
  const uint4* landed = landing_of_thread<Cfg>(plan, w, thread);
  CUTE_UNROLL
  for (int i = 0; i < kGroups; i += 2) {
    const int j = kKeep + i;
    const uint4 v = landed[i / 2 * kWarpgroupThreads];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    CUTE_UNROLL
    for (int k = 0; k < 4; ++k) {  // a bf16 is the high half of the float it widens to
      acc(4 * j + 2 * k) += __uint_as_float(words[k] << 16);
      acc(4 * j + 2 * k + 1) += __uint_as_float(words[k] & 0xFFFF0000u);
    }
  }
  warpgroup_fence_operand(acc);
  if constexpr (!Cfg::kDeterministic) {
    // The relaxed arrival below does not order the landing's loads in the
    // memory model, and ptxas may consume them after it (the D = 576
    // rope-tile merges: loads issued, then the arrival, then the adds): the
    // loads' issue order and the partner's round trip before it can write
    // are what keep its next half out until they return (KERNELS.md). A
    // release arrival would also wait for the warp's earlier reductions.
    __syncwarp();
    free_landing<Cfg>(plan, role, last_of_block, lane);
    reduce_dkv_tile<Cfg, kKeep, kGroups>(p, acc, rows, tile, fixed, lane);
  } else {
    char* staging = reinterpret_cast<char*>(plan.kv + (bwd::kLandingStage + w) * Cfg::Ring::kStageElems) +
                    bwd::kHalfTileBytes + (thread % kWarpgroupThreads) / 32 * kWarpStagingBytes;
    CUTE_UNROLL
    for (int pass = 0; pass < 2; ++pass) {
      CUTE_UNROLL
      for (int rh = 0; rh < 2; ++rh) {
        __syncwarp();  // the rows staged before have been read
        stage_fixed_warp_rows<kKeep / 2>(staging, acc, rows, pass, rh, fixed, lane);
        __syncwarp();
        reduce_fixed_warp_rows<kRank>(p, staging, rows.offset[rh], tile, pass, lane);
      }
    }
    // The relaxed free: the partner writes only the landing's lower half,
    // whose loads feed the adds and so the staged stores issued before it;
    // the staged rows are this warp's alone; after the block's last tile the
    // free is the ring's release arrival.
    __syncwarp();
    free_landing<Cfg>(plan, role, last_of_block, lane);
  }
}

// A waited dKV tile: reduced into the kv gradient alone, or merged with the
// pair's other partial, each rank reducing half of its columns.
template <class Cfg, class Acc, bool kPaired, class OnStep = timeline::NoMark>
__device__ __forceinline__ void finish_dkv_tile(typename Cfg::SharedMemoryPlan& plan, const SparseMlaBwdParams& p,
                                                Acc& acc, const KeyRows& rows, int tile, const FixedTerms& fixed,
                                                PairRole<kPaired>& role, bool last_of_block, int thread,
                                                OnStep on_step = {}) {
  if constexpr (!kPaired) {
    reduce_dkv_tile<Cfg, 0, kDimTile / 8>(p, acc, rows, tile, fixed, thread % 32);
  } else {
    if (role.rank == 0) merge_dkv_tile<Cfg, 0>(plan, p, acc, rows, tile, fixed, role, last_of_block, thread, on_step);
    else merge_dkv_tile<Cfg, 1>(plan, p, acc, rows, tile, fixed, role, last_of_block, thread, on_step);
  }
}

// This warpgroup's dKV tiles of the block: the rope tile (with_rope), then
// value tiles [first_value, first_value + num_values), each computed, waited
// for and added into the kv gradient (in a pair: merged, half by each rank).
// `done_barrier` is arrived at once the last WGMMA that reads P and dS has
// completed (if another block follows). on_tile_done(i) follows the i-th
// tile's merge, and on_first_value_step(MergeStep) the steps of the first
// value tile's (the timeline build marks them).
template <class Cfg, bool kPaired, class OnTileDone = timeline::NoMark, class OnStep = timeline::NoMark>
__device__ __forceinline__ void dkv_tiles(typename Cfg::SharedMemoryPlan& plan, const SparseMlaBwdParams& p,
                                          const KeyRows& rows, bool with_rope, int first_value, int num_values,
                                          bool more_blocks, uint32_t done_barrier, const FixedTerms& fixed,
                                          PairRole<kPaired>& role, int thread, OnTileDone on_tile_done = {},
                                          OnStep on_first_value_step = {}) {
  Tensor acc = partition_fragment_C(typename Cfg::MmaDkv{}, Shape<Int<kBlockTopk>, Int<kDimTile>>{});
  if constexpr (Cfg::kRopeTiles > 0) {
    if (with_rope) {
      issue_dkv_tile<Cfg, false>(plan, bwd::kValueTiles, acc, thread);
      warpgroup_wait<0>();
      finish_dkv_tile<Cfg>(plan, p, acc, rows, bwd::kValueTiles, fixed, role, num_values == 0, thread);
      on_tile_done(num_values);
    }
  }
  CUTE_NO_UNROLL
  for (int t = 0; t < num_values; ++t) {
    const int tile = first_value + t;
    issue_dkv_tile<Cfg, true>(plan, tile, acc, thread);
    warpgroup_wait<0>();
    auto step = [&](int s) { if (t == 0) on_first_value_step(s); };
    step(kMergeProductDone);
    if (t + 1 == num_values && more_blocks) NamedBarrier::arrive(bwd::kPairThreads, done_barrier);
    finish_dkv_tile<Cfg>(plan, p, acc, rows, tile, fixed, role, t + 1 == num_values, thread, step);
    on_tile_done(t);
  }
}

// Each TMA tile (Q's or dO's) of the row has landed; a warpgroup waits once
// before it first reads tiles that the other warpgroup's product waited for.
__device__ __forceinline__ void wait_tiles_landed(uint64_t* ready, int n) {
  for (int i = 0; i < n; ++i) cutlass::arch::ClusterTransactionBarrier::wait(&ready[i], 0);
}

// The consumer's dQ columns: bf16 pairs straight from the accumulator
// (heads past H are not written).
template <class Cfg, class Acc>
__device__ __forceinline__ void store_dq(const SparseMlaBwdParams& p, const CtaProblem& c, const Acc& acc,
                                         int first_col, int thread) {
  const int lane = thread % 32;
  const int64_t token = int64_t(c.batch) * p.s_q + c.s;
  CUTE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const int head = c.head_tile * Cfg::HT + acc_row(thread, rh);
    if (head >= p.h_q) continue;
    bf16* row = static_cast<bf16*>(p.dq) + (token * p.h_q + head) * Cfg::D + first_col;
    CUTE_UNROLL
    for (int j = 0; j < size(acc) / 4; ++j)
      *reinterpret_cast<__nv_bfloat162*>(row + 8 * j + 2 * (lane % 4)) =
          __floats2bfloat162_rn(acc(4 * j + 2 * rh), acc(4 * j + 2 * rh + 1));
  }
}

}  // namespace sparse_mla
}  // namespace attn_dist
