// XLA FFI handler symbols of the CUDA targets (see ffi.cc) and their names.
// jax_attn_dist/_contract.py holds the same names (FFI_TARGETS); a test checks
// that registrations() offers exactly those.
#pragma once

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace attn_dist {

// attn_dist: (q, k, indices, lse, q_start) -> out.
inline constexpr const char* kAttnDistTarget = "jax_attn_dist_fwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAttnDistFwd);
// The same, plus an operand aliased to the output. Tests fill it with NaN so
// that an element the kernel does not write shows.
inline constexpr const char* kAttnDistPoisonedTarget = "jax_attn_dist_fwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAttnDistFwdInto);

// indexer_kl forward: (index_q, index_k, weights, indices, target, q_start) -> (kl, lse).
inline constexpr const char* kIndexerFwdTarget = "jax_attn_dist_indexer_fwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerFwd);
// The same, plus two operands aliased to (kl, lse), for poisoned tests.
inline constexpr const char* kIndexerFwdPoisonedTarget = "jax_attn_dist_indexer_fwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerFwdInto);

// The head dims the kernels are built for (also in _contract.py; tested equal).
inline constexpr int kAttnDistHeadDims[] = {512, 576};
inline constexpr int kIndexerHeadDims[] = {64, 128};
inline constexpr int kIndexerMaxHeads = 256;

}  // namespace attn_dist
