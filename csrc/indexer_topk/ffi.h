// The indexer_topk op's XLA FFI target (indexer_topk/ffi.cc): its name and
// handler symbol. jax_attn_dist's op contract holds the same name (a test
// checks that registrations() offers it).
#pragma once

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace attn_dist {

// (index_q [B, S, HI, DI] and index_k [B, N, DI], both bf16 or both f8e4m3fn, weights [B, S, HI] f32,
//  index_k_scale [B, N] f32, q_start [B] s32[, row_ranges [B, S, 3] or [B, S, 0] s32])
//   -> indices [B, S, 1, topk] s32; attributes scale (f32), causal (bool), k_stride (s32).
inline constexpr const char* kIndexerTopkTarget = "jax_attn_dist_indexer_topk";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerTopk);

}  // namespace attn_dist
