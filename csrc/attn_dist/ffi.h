// The attn_dist op's XLA FFI target (attn_dist/ffi.cc): its name, handler
// symbol, and what csrc/testing/ reuses for its poisoned twin: the checked
// body and the operand list. jax_attn_dist's op contract holds the same name
// (a test checks that registrations() offers it).
#pragma once

#include <cstdint>
#include <utility>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

#include "../common/ffi_checks.h"

namespace attn_dist {

// (q, k, indices, lse, q_start[, row_ranges]) -> out. row_ranges: int32
// [B, S, 3] (SPEC §6, see common/slot_validity.cuh), [B, S, 0] or absent for
// none (absent: calls exported before it existed).
inline constexpr const char* kAttnDistFwdTarget = "jax_attn_dist_fwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAttnDistFwd);

// The handler's checks and launch; `target` names it in errors.
ffi::Error AttnDistFwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                           ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse,
                           ffi::Buffer<ffi::S32> q_start, OptionalRanges row_ranges,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, bool causal, int32_t k_stride,
                           bool lse_base_e);

// The operand list up to q_start, and the results and attributes after the
// row ranges (shared with the poisoned twin, which has more operands between).
inline auto AttnDistOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::BF16>>()   // q
      .Arg<ffi::Buffer<ffi::BF16>>()   // k
      .Arg<ffi::Buffer<ffi::S32>>()    // indices
      .Arg<ffi::Buffer<ffi::F32>>()    // lse
      .Arg<ffi::Buffer<ffi::S32>>();   // q_start
}

template <class Binding>
auto AttnDistResultsAndAttrs(Binding b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::F32>>()  // out
      .template Attr<float>("sm_scale")
      .template Attr<bool>("causal")
      .template Attr<int32_t>("k_stride")
      .template Attr<bool>("lse_base_e");
}

}  // namespace attn_dist
