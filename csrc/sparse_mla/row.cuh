// What the sparse MLA forward and backward kernels know of their query row:
// the CTA's (batch, token, head tile) and slots, and a key block's validity
// mask (the shared rule, common/slot_validity.cuh).
#pragma once

#include <cstdint>

#include "../common/cta.cuh"
#include "../common/slot_validity.cuh"

namespace attn_dist {
namespace sparse_mla {

// Per-CTA facts shared by producer and consumers.
struct CtaProblem : HeadTileCta {
  RowSlots slots;
};

// Params: SparseMlaFwdParams or SparseMlaBwdParams.
template <class Cfg, class Params>
__device__ __forceinline__ CtaProblem locate_cta(const Params& p) {
  CtaProblem c;
  static_cast<HeadTileCta&>(c) = head_tile_cta(blockIdx.x, Cfg::num_head_tiles(p.h_q), p.s_q);
  c.slots = make_row_slots(p.indices, c.batch, c.s, p.s_q, p.topk, p.s_kv, p.causal, p.q_start, p.k_stride,
                           p.row_ranges);
  return c;
}

// The slot indices of a block that this lane tests (slots lane and lane + 32),
// loaded before the scores' WGMMAs so that the loads overlap them.
struct BlockSlots {
  int32_t lo, hi;
};
__device__ __forceinline__ BlockSlots load_block_slots(const RowSlots& slots, int block, int lane) {
  const int t = block * kBlockTopk + lane;
  return {slots.load(t), slots.load(t + 32)};
}
// Bit c: slot 64 * block + c is valid (the shared rule, common/slot_validity.cuh).
__device__ __forceinline__ uint64_t valid_slot_mask(const RowSlots& slots, BlockSlots b) {
  const uint32_t lo = __ballot_sync(0xffffffffu, slots.valid(b.lo));
  const uint32_t hi = __ballot_sync(0xffffffffu, slots.valid(b.hi));
  return uint64_t(hi) << 32 | lo;
}

}  // namespace sparse_mla
}  // namespace attn_dist
