// The sparse_mla op's XLA FFI targets (sparse_mla/ffi.cc): their names and
// handler symbols, and what csrc/testing/ reuses for the poisoned twins of
// the forward and the backward: the checked bodies and the backward's operand
// list. jax_attn_dist's op contract holds the same names (a test checks that
// registrations() offers them).
#pragma once

#include <cstdint>
#include <utility>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

#include "../common/ffi_checks.h"

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

// The forward's and the backward's checks and launch; `target` names them in
// errors.
ffi::Error SparseMlaFwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                            ffi::Buffer<ffi::BF16> kv, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                            OptionalRanges row_ranges, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale, bool causal, int32_t k_stride,
                            bool lse_base_e);
ffi::Error SparseMlaBwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                            ffi::Buffer<ffi::BF16> kv, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                            ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::BF16> out, ffi::Buffer<ffi::F32> lse,
                            ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::F32> dlse,
                            ffi::Result<ffi::Buffer<ffi::BF16>> dq, ffi::Result<ffi::Buffer<ffi::F32>> dkv,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, float sm_scale, bool causal,
                            int32_t k_stride, bool lse_base_e, bool deterministic);

// The attributes every sparse_mla handler takes, after its results.
template <class Binding>
auto SparseMlaAttrs(Binding b) {
  return std::move(b).template Attr<float>("sm_scale")
      .template Attr<bool>("causal")
      .template Attr<int32_t>("k_stride")
      .template Attr<bool>("lse_base_e");
}

// The forward's operands up to q_start, and its results and attributes after
// the row ranges (shared with the poisoned twin, which has more operands
// between).
inline auto SparseMlaFwdOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::BF16>>()  // q
      .Arg<ffi::Buffer<ffi::BF16>>()  // kv
      .Arg<ffi::Buffer<ffi::S32>>()   // indices
      .Arg<ffi::Buffer<ffi::S32>>();  // q_start
}

template <class Binding>
auto SparseMlaFwdResultsAndAttrs(Binding b) {
  return SparseMlaAttrs(std::move(b).template Ret<ffi::Buffer<ffi::BF16>>()  // out
                            .template Ret<ffi::Buffer<ffi::F32>>());         // lse
}

// The operands every backward handler takes first, in this order: the
// forward's inputs and outputs and the cotangents.
inline auto SparseMlaBwdOperands() {
  return SparseMlaFwdOperands()
      .Arg<ffi::Buffer<ffi::S32>>()   // row_ranges ([B, S, 0]: none)
      .Arg<ffi::Buffer<ffi::BF16>>()  // out
      .Arg<ffi::Buffer<ffi::F32>>()   // lse
      .Arg<ffi::Buffer<ffi::BF16>>()  // dout
      .Arg<ffi::Buffer<ffi::F32>>();  // dlse
}

// The backward's results and attributes (shared with its poisoned twin).
template <class Binding>
auto SparseMlaBwdResultsAndAttrs(Binding b) {
  return SparseMlaAttrs(std::move(b).template Ret<ffi::Buffer<ffi::BF16>>()  // dq
                            .template Ret<ffi::Buffer<ffi::F32>>()           // dkv
                            .template Ret<ffi::Buffer<ffi::U8>>())           // workspace
      .template Attr<bool>("deterministic");
}

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
