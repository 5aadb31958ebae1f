// The index-validity rule of docs/SPEC.md §2 and §6, shared by every kernel.
//
// Slot t of query row s selects key i = indices[b, s, 0, t] (any int32). It is
// valid when t < the row's live slot count and key_begin <= i < key_end, with
// * no row ranges (SPEC §2): every slot live, key_begin = 0, key_end = N, or,
//   if causal, min(N, floor((q_start + s + 1 - k_stride) / k_stride) + 1);
// * row ranges [B, S, 3] (SPEC §6, computed in XLA from cu_seqlens,
//   topk_length, causal and q_start; see jax_attn_dist/_core/packing.py): the row's
//   (key_begin, key_end, topk_length), clamped here into [0, N] and [0, T] so
//   that no value can make a kernel read out of bounds.
// A kernel builds one RowSlots per query row and asks it; nothing else
// decides validity. Slots past the live count are never loaded, so whole
// blocks past it are skipped.
#pragma once

#include <cstdint>

#include "params.h"  // kRowRangeFields

namespace attn_dist {

constexpr int kBlockTopk = 64;  // slots per block: the M of a key-block WGMMA

__host__ __device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

struct RowSlots {
  const int32_t* indices;    // this row's slot indices (the row holds T of them)
  int topk;                  // live slots: 0 .. topk - 1 (T, or the row's clamped topk_length)
  // Keys key_begin .. key_begin + key_span - 1 are valid for this row, inside
  // [0, N]. Then "key_begin <= i < key_begin + key_span" is one unsigned
  // compare: (uint32(i) - key_begin) wraps past key_span for every i below.
  uint32_t key_begin;
  uint32_t key_span;

  // The raw index of slot t (any int32), or -1 past the live slots.
  __device__ __forceinline__ int32_t load(int t) const { return t < topk ? __ldg(indices + t) : -1; }

  // The position of slot index i in the row's key range (any value when i
  // is invalid): valid exactly when it is < key_span.
  __device__ __forceinline__ uint32_t key_offset(int32_t i) const { return uint32_t(i) - key_begin; }
  __device__ __forceinline__ bool valid(int32_t i) const { return key_offset(i) < key_span; }

  // The key of a slot index if it is valid, else -1.
  __device__ __forceinline__ int32_t key_if_valid(int32_t i) const { return valid(i) ? i : -1; }

  __device__ __forceinline__ int num_blocks() const { return (topk + kBlockTopk - 1) / kBlockTopk; }
};

__device__ __forceinline__ int32_t clamp_to(int32_t x, int32_t lo, int32_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// The keys row s of batch element b may see, key_begin .. key_begin +
// key_span - 1 inside [0, N] (row_ranges [B, S, 3] or nullptr): the range
// part of RowSlots, shared with kernels that select keys rather than take
// slot indices (indexer_topk).
struct KeyRange {
  uint32_t begin;
  uint32_t span;
};

__device__ __forceinline__ KeyRange make_key_range(int b, int s, int s_q, int num_keys, bool causal,
                                                   const int32_t* q_start, int k_stride,
                                                   const int32_t* row_ranges) {
  if (row_ranges != nullptr) {
    const int32_t* bounds = row_ranges + (int64_t(b) * s_q + s) * kRowRangeFields;
    const int32_t begin = clamp_to(__ldg(bounds), 0, num_keys);
    const int32_t end = clamp_to(__ldg(bounds + 1), begin, num_keys);
    // An empty range starts at 0, so that the gather's dummy source row
    // (offset 0, never read) stays inside the key array.
    return KeyRange{uint32_t(end > begin ? begin : 0), uint32_t(end - begin)};
  }
  int64_t limit = num_keys;
  if (causal) {
    // Query at absolute position q_start + s sees key i iff
    // i <= floor((q_start + s + 1 - k_stride) / k_stride). 64-bit: no overflow.
    const int64_t pos = int64_t(q_start[b]) + s;
    const int64_t max_visible_key = floor_div(pos + 1 - k_stride, k_stride);
    limit = max_visible_key + 1 < limit ? max_visible_key + 1 : limit;
  }
  return KeyRange{0u, uint32_t(limit > 0 ? limit : 0)};
}

// The slots of query row s of batch element b (indices laid out [B, S, T];
// row_ranges [B, S, 3] or nullptr).
__device__ __forceinline__ RowSlots make_row_slots(const int32_t* indices, int b, int s, int s_q, int topk,
                                                   int num_keys, bool causal, const int32_t* q_start,
                                                   int k_stride, const int32_t* row_ranges) {
  const int64_t row = int64_t(b) * s_q + s;
  RowSlots r;
  r.indices = indices + row * topk;
  const KeyRange keys = make_key_range(b, s, s_q, num_keys, causal, q_start, k_stride, row_ranges);
  r.key_begin = keys.begin;
  r.key_span = keys.span;
  r.topk = row_ranges != nullptr ? clamp_to(__ldg(row_ranges + row * kRowRangeFields + 2), 0, topk) : topk;
  return r;
}

}  // namespace attn_dist
