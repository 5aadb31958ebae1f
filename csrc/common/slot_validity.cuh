// The index-validity rule of docs/SPEC.md §2, shared by every kernel.
//
// Slot t of query row s selects key i = indices[b, s, 0, t] (any int32). It is
// valid when 0 <= i < N and, if causal, i <= floor((q_start + s + 1 - k_stride)
// / k_stride). A kernel builds one RowSlots per query row and asks it; nothing
// else decides validity.
#pragma once

#include <cstdint>

namespace attn_dist {

constexpr int kBlockTopk = 64;  // slots per block: the M of a key-block WGMMA

__host__ __device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

struct RowSlots {
  const int32_t* indices;    // this row's T slot indices
  int topk;                  // T
  // Keys 0 .. key_limit - 1 are valid for this row: min(N, the causal bound + 1),
  // at least 0. Then "0 <= i < N and i <= bound" is one unsigned compare.
  uint32_t key_limit;

  // The raw index of slot t (any int32), or -1 past T.
  __device__ __forceinline__ int32_t load(int t) const { return t < topk ? __ldg(indices + t) : -1; }

  // The key of a slot index if it is valid (in [0, N) and causally visible), else -1.
  __device__ __forceinline__ int32_t key_if_valid(int32_t i) const { return uint32_t(i) < key_limit ? i : -1; }

  __device__ __forceinline__ int num_blocks() const { return (topk + kBlockTopk - 1) / kBlockTopk; }
};

// The slots of query row s of batch element b (indices laid out [B, S, T]).
__device__ __forceinline__ RowSlots make_row_slots(const int32_t* indices, int b, int s, int s_q, int topk,
                                                   int num_keys, bool causal, const int32_t* q_start,
                                                   int k_stride) {
  RowSlots r;
  r.indices = indices + (int64_t(b) * s_q + s) * topk;
  r.topk = topk;
  int64_t limit = num_keys;
  if (causal) {
    // Query at absolute position q_start + s sees key i iff
    // i <= floor((q_start + s + 1 - k_stride) / k_stride). 64-bit: no overflow.
    const int64_t pos = int64_t(q_start[b]) + s;
    const int64_t max_visible_key = floor_div(pos + 1 - k_stride, k_stride);
    limit = max_visible_key + 1 < limit ? max_visible_key + 1 : limit;
  }
  r.key_limit = uint32_t(limit > 0 ? limit : 0);
  return r;
}

}  // namespace attn_dist
