// XLA FFI handler symbols of the CUDA targets (see ffi.cc) and their names.
// jax_attn_dist/_contract.py holds the same names (FFI_TARGETS); a test checks
// that registrations() offers exactly those.
#pragma once

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace attn_dist {

// attn_dist: (q, k, indices, lse, q_start[, row_ranges]) -> out. row_ranges:
// int32 [B, S, 3] (SPEC §6, see common/slot_validity.cuh), [B, S, 0] or
// absent for none (absent: calls exported before it existed).
inline constexpr const char* kAttnDistTarget = "jax_attn_dist_fwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAttnDistFwd);
// The same with row_ranges required, plus an operand aliased to the output
// (q, k, indices, lse, q_start, row_ranges, out_init). Tests fill it with NaN so
// that an element the kernel does not write shows.
inline constexpr const char* kAttnDistPoisonedTarget = "jax_attn_dist_fwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAttnDistFwdInto);

// indexer_kl forward: (index_q, index_k, weights, indices, target, q_start[, row_ranges]) -> (kl, lse).
inline constexpr const char* kIndexerFwdTarget = "jax_attn_dist_indexer_fwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerFwd);
// The same with row_ranges required, plus two operands aliased to (kl, lse),
// for poisoned tests.
inline constexpr const char* kIndexerFwdPoisonedTarget = "jax_attn_dist_indexer_fwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerFwdInto);

// indexer_kl backward: (index_q, index_k, weights, indices, target, q_start, lse, g[, row_ranges])
//   -> (d_index_q bf16, d_weights f32, d_index_k f32, workspace u8); the
//   workspace is 8 * (B * N * DI + 1) bytes with deterministic=True, else empty.
inline constexpr const char* kIndexerBwdTarget = "jax_attn_dist_indexer_bwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerBwd);
// The same with row_ranges required (after g), plus three operands aliased
// to the results, for poisoned tests.
inline constexpr const char* kIndexerBwdPoisonedTarget = "jax_attn_dist_indexer_bwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerBwdInto);

// The head dims the kernels are built for (also in _contract.py; tested equal).
inline constexpr int kAttnDistHeadDims[] = {512, 576};
inline constexpr int kIndexerHeadDims[] = {64, 128};
inline constexpr int kIndexerMaxHeads = 256;
inline constexpr int kIndexerBwdMaxHeads = 64;

}  // namespace attn_dist
