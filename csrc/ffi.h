// XLA FFI handler symbols of the CUDA target (see ffi.cc).
#pragma once

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace attn_dist {

// "jax_attn_dist_fwd": (q, k, indices, lse, q_start) -> out.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAttnDistFwd);
// "jax_attn_dist_fwd_into": the same, plus an operand aliased to the output.
// Tests fill it with NaN so that an element the kernel does not write shows.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAttnDistFwdInto);

}  // namespace attn_dist
