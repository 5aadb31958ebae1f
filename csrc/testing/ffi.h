// Test-only XLA FFI targets: each op target's "poisoned" twin, the same
// handler with row_ranges required and extra operands aliased to the outputs.
// Tests fill those with NaN so that an element the kernel does not write
// shows. Built and registered only with the CMake option
// JAX_ATTN_DIST_TEST_TARGETS=ON (see CMakeLists.txt); never in a release build.
#pragma once

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace attn_dist {

// (q, k, indices, lse, q_start, row_ranges, out_init) -> out, out_init aliased
// to out (input_output_aliases={6: 0}).
inline constexpr const char* kAttnDistFwdIntoTarget = "jax_attn_dist_fwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAttnDistFwdInto);

// (index_q, index_k, weights, indices, target, q_start, row_ranges, kl_init,
// lse_init) -> (kl, lse), aliased {7: 0, 8: 1}.
inline constexpr const char* kIndexerFwdIntoTarget = "jax_attn_dist_indexer_fwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerFwdInto);

// (index_q, index_k, weights, indices, target, q_start, lse, g, row_ranges,
// dq_init, dw_init, dk_init) -> (d_index_q, d_weights, d_index_k, workspace),
// aliased {9: 0, 10: 1, 11: 2}.
inline constexpr const char* kIndexerBwdIntoTarget = "jax_attn_dist_indexer_bwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerBwdInto);

// (q, kv, indices, q_start, row_ranges, out_init, lse_init) -> (out, lse),
// aliased {5: 0, 6: 1}.
inline constexpr const char* kSparseMlaFwdIntoTarget = "jax_attn_dist_sparse_mla_fwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kSparseMlaFwdInto);

// (the backward's nine operands, dq_init, dkv_init) -> (dq, dkv, workspace),
// aliased {9: 0, 10: 1}.
inline constexpr const char* kSparseMlaBwdIntoTarget = "jax_attn_dist_sparse_mla_bwd_into";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kSparseMlaBwdInto);

}  // namespace attn_dist
