// The indexer_kl op's XLA FFI targets (indexer/ffi.cc): their names, handler
// symbols, and what csrc/testing/ reuses for the poisoned twins: the checked
// bodies and the operand lists. jax_attn_dist's op contract holds the same
// names (a test checks that registrations() offers them).
#pragma once

#include <cstdint>
#include <utility>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

#include "../common/ffi_checks.h"

namespace attn_dist {

// Forward: (index_q, index_k, weights, indices, target, q_start[, row_ranges]) -> (kl, lse).
inline constexpr const char* kIndexerFwdTarget = "jax_attn_dist_indexer_fwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerFwd);

// Backward: (index_q, index_k, weights, indices, target, q_start, lse, g[, row_ranges])
//   -> (d_index_q bf16, d_weights f32, d_index_k f32, workspace u8); the
//   workspace is 8 * (B * N * DI + 1) bytes with deterministic=True, else empty.
inline constexpr const char* kIndexerBwdTarget = "jax_attn_dist_indexer_bwd";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerBwd);

// The deterministic backward of a call whose rows are sharded, split around
// its all-reduces: (index_q, index_k, weights, indices, target, q_start, lse,
// g[, row_ranges]) -> bound int32 [1] (the rows' largest bound, as float
// bits); then (the same up to g, bound maxed over the shards[, row_ranges])
// -> (d_index_q, d_weights, limbs int32 [3, 1, B * N * DI], flags int32 [1],
// workspace u8 [8 * (B * N * DI + 1)]), attr scale_rows int64 besides the
// forward's.
inline constexpr const char* kIndexerBwdBoundTarget = "jax_attn_dist_indexer_bwd_bound";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerBwdBound);
inline constexpr const char* kIndexerBwdFixedTarget = "jax_attn_dist_indexer_bwd_fixed";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexerBwdFixed);

// The handlers' checks and launches; `target` names them in errors.
ffi::Error IndexerFwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q,
                          ffi::Buffer<ffi::BF16> index_k, ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> target_dist,
                          ffi::Buffer<ffi::S32> q_start, OptionalRanges row_ranges,
                          ffi::Result<ffi::Buffer<ffi::F32>> kl, ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                          bool causal, int32_t k_stride);
ffi::Error IndexerBwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q,
                          ffi::Buffer<ffi::BF16> index_k, ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> target_dist,
                          ffi::Buffer<ffi::S32> q_start, OptionalRanges row_ranges, ffi::Buffer<ffi::F32> lse,
                          ffi::Buffer<ffi::F32> g, ffi::Result<ffi::Buffer<ffi::BF16>> d_index_q,
                          ffi::Result<ffi::Buffer<ffi::F32>> d_weights, ffi::Result<ffi::Buffer<ffi::F32>> d_index_k,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale, bool causal, int32_t k_stride,
                          bool deterministic);

// The operand lists before the row ranges, and the results and attributes
// after them (shared with the poisoned twins, which have more operands between).
inline auto IndexerOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::BF16>>()   // index_q
      .Arg<ffi::Buffer<ffi::BF16>>()   // index_k
      .Arg<ffi::Buffer<ffi::F32>>()    // weights
      .Arg<ffi::Buffer<ffi::S32>>()    // indices
      .Arg<ffi::Buffer<ffi::F32>>()    // target
      .Arg<ffi::Buffer<ffi::S32>>();   // q_start
}

template <class Binding>
auto IndexerResultsAndAttrs(Binding b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::F32>>()  // kl
      .template Ret<ffi::Buffer<ffi::F32>>()      // lse
      .template Attr<float>("scale")
      .template Attr<bool>("causal")
      .template Attr<int32_t>("k_stride");
}

inline auto IndexerBwdOperands() {
  return IndexerOperands()
      .Arg<ffi::Buffer<ffi::F32>>()    // lse
      .Arg<ffi::Buffer<ffi::F32>>();   // g
}

template <class Binding>
auto IndexerBwdResultsAndAttrs(Binding b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::BF16>>()  // d_index_q
      .template Ret<ffi::Buffer<ffi::F32>>()      // d_weights
      .template Ret<ffi::Buffer<ffi::F32>>()      // d_index_k
      .template Ret<ffi::Buffer<ffi::U8>>()       // workspace (deterministic mode)
      .template Attr<float>("scale")
      .template Attr<bool>("causal")
      .template Attr<int32_t>("k_stride")
      .template Attr<bool>("deterministic");
}

}  // namespace attn_dist
