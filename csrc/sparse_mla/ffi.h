// The sparse_mla op's XLA FFI target (sparse_mla/ffi.cc): its name and
// handler symbol. jax_attn_dist's op contract holds the same name (a test
// checks that registrations() offers it).
#pragma once

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace attn_dist {

// (q, kv, indices, q_start[, row_ranges]) -> (out, lse). row_ranges: int32
// [B, S, 3] (SPEC §6, see common/slot_validity.cuh) or [B, S, 0] for none.
inline constexpr const char* kSparseMlaFwdTarget = "jax_attn_dist_sparse_mla_fwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kSparseMlaFwd);

}  // namespace attn_dist
