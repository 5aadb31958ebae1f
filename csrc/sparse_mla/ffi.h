// The sparse_mla op's XLA FFI targets (sparse_mla/ffi.cc): their names and
// handler symbols. jax_attn_dist's op contract holds the same name (a test
// checks that registrations() offers it).
#pragma once

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace attn_dist {

// (q, kv, indices, q_start[, row_ranges]) -> (out, lse). row_ranges: int32
// [B, S, 3] (SPEC §6, see common/slot_validity.cuh) or [B, S, 0] for none.
inline constexpr const char* kSparseMlaFwdTarget = "jax_attn_dist_sparse_mla_fwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kSparseMlaFwd);

// (q, kv, indices, q_start, row_ranges, out, lse, dout, dlse) -> (dq, dkv
// float32, workspace); row_ranges [B, S, 3] or [B, S, 0]; attrs as the
// forward's plus deterministic.
inline constexpr const char* kSparseMlaBwdTarget = "jax_attn_dist_sparse_mla_bwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kSparseMlaBwd);

// The deterministic backward of a call whose rows are sharded, split around
// its all-reduces: (the backward's nine operands) -> (row_delta f32 [B, S,
// H], scale_words int32 [2, B]); then (the nine, row_delta, scale_words
// maxed over the shards) -> (dq, limbs int32 [3, B, N, 1, D], flags int32
// [B], workspace), attr scale_rows int64 besides the forward's.
inline constexpr const char* kSparseMlaBwdBoundTarget = "jax_attn_dist_sparse_mla_bwd_bound";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kSparseMlaBwdBound);
inline constexpr const char* kSparseMlaBwdFixedTarget = "jax_attn_dist_sparse_mla_bwd_fixed";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kSparseMlaBwdFixed);

}  // namespace attn_dist
