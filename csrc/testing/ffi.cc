// The poisoned twins of the op targets (testing/ffi.h): the op handlers'
// checked bodies (attn_dist/ffi.cc, indexer/ffi.cc, sparse_mla/ffi.cc) after a check that the
// extra operands are aliased to the outputs. The row ranges come in place,
// before the aliased inputs.
#include "ffi.h"

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../attn_dist/ffi.h"
#include "../indexer/ffi.h"
#include "../sparse_mla/ffi.h"

namespace attn_dist {
namespace {

ffi::Error AttnDistFwdIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                               ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse,
                               ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> row_ranges,
                               ffi::Buffer<ffi::F32> out_init,
                               ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, bool causal,
                               int32_t k_stride, bool lse_base_e) {
  if (out_init.untyped_data() != out->untyped_data())
    return Checker{kAttnDistFwdIntoTarget}.Invalid(
        "out_init must be aliased to the output (input_output_aliases={6: 0})");
  return AttnDistFwdCall(kAttnDistFwdIntoTarget, stream, q, k, indices, lse, q_start, row_ranges, out, sm_scale,
                         causal, k_stride, lse_base_e);
}

ffi::Error IndexerFwdIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                              ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                              ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                              ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::F32> kl_init,
                              ffi::Buffer<ffi::F32> lse_init,
                              ffi::Result<ffi::Buffer<ffi::F32>> kl, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              float scale, bool causal, int32_t k_stride) {
  if (kl_init.untyped_data() != kl->untyped_data() || lse_init.untyped_data() != lse->untyped_data())
    return Checker{kIndexerFwdIntoTarget}.Invalid(
        "kl_init and lse_init must be aliased to the outputs (input_output_aliases={7: 0, 8: 1})");
  return IndexerFwdCall(kIndexerFwdIntoTarget, stream, index_q, index_k, weights, indices, target_dist, q_start,
                        row_ranges, kl, lse, scale, causal, k_stride);
}

ffi::Error IndexerBwdIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                              ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                              ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                              ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::S32> row_ranges,
                              ffi::Buffer<ffi::BF16> dq_init,
                              ffi::Buffer<ffi::F32> dw_init, ffi::Buffer<ffi::F32> dk_init,
                              ffi::Result<ffi::Buffer<ffi::BF16>> d_index_q,
                              ffi::Result<ffi::Buffer<ffi::F32>> d_weights,
                              ffi::Result<ffi::Buffer<ffi::F32>> d_index_k,
                              ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale, bool causal,
                              int32_t k_stride, bool deterministic) {
  if (dq_init.untyped_data() != d_index_q->untyped_data() || dw_init.untyped_data() != d_weights->untyped_data() ||
      dk_init.untyped_data() != d_index_k->untyped_data())
    return Checker{kIndexerBwdIntoTarget}.Invalid(
        "dq_init, dw_init and dk_init must be aliased to the outputs (input_output_aliases={9: 0, 10: 1, 11: 2})");
  return IndexerBwdCall(kIndexerBwdIntoTarget, stream, index_q, index_k, weights, indices, target_dist, q_start,
                        row_ranges, lse, g, d_index_q, d_weights, d_index_k, workspace, scale, causal, k_stride,
                        deterministic);
}

ffi::Error SparseMlaFwdIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> kv,
                                ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                                ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::BF16> out_init,
                                ffi::Buffer<ffi::F32> lse_init, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale, bool causal, int32_t k_stride,
                                bool lse_base_e) {
  if (out_init.untyped_data() != out->untyped_data() || lse_init.untyped_data() != lse->untyped_data())
    return Checker{kSparseMlaFwdIntoTarget}.Invalid(
        "out_init and lse_init must be aliased to the outputs (input_output_aliases={5: 0, 6: 1})");
  return SparseMlaFwdCall(kSparseMlaFwdIntoTarget, stream, q, kv, indices, q_start, OptionalRanges(row_ranges), out,
                          lse, sm_scale, causal, k_stride, lse_base_e);
}

ffi::Error SparseMlaBwdIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> kv,
                                ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                                ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::BF16> out,
                                ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::F32> dlse,
                                ffi::Buffer<ffi::BF16> dq_init, ffi::Buffer<ffi::F32> dkv_init,
                                ffi::Result<ffi::Buffer<ffi::BF16>> dq, ffi::Result<ffi::Buffer<ffi::F32>> dkv,
                                ffi::Result<ffi::Buffer<ffi::U8>> workspace, float sm_scale, bool causal,
                                int32_t k_stride, bool lse_base_e, bool deterministic) {
  if (dq_init.untyped_data() != dq->untyped_data() || dkv_init.untyped_data() != dkv->untyped_data())
    return Checker{kSparseMlaBwdIntoTarget}.Invalid(
        "dq_init and dkv_init must be aliased to the outputs (input_output_aliases={9: 0, 10: 1})");
  return SparseMlaBwdCall(kSparseMlaBwdIntoTarget, stream, q, kv, indices, q_start, row_ranges, out, lse, dout, dlse,
                          dq, dkv, workspace, sm_scale, causal, k_stride, lse_base_e, deterministic);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttnDistFwdInto, AttnDistFwdIntoImpl,
                              AttnDistResultsAndAttrs(AttnDistOperands()
                                                          .Arg<ffi::Buffer<ffi::S32>>()    // row_ranges
                                                          .Arg<ffi::Buffer<ffi::F32>>()),  // out_init
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerFwdInto, IndexerFwdIntoImpl,
                              IndexerResultsAndAttrs(IndexerOperands()
                                                         .Arg<ffi::Buffer<ffi::S32>>()    // row_ranges
                                                         .Arg<ffi::Buffer<ffi::F32>>()    // kl_init
                                                         .Arg<ffi::Buffer<ffi::F32>>()),  // lse_init
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerBwdInto, IndexerBwdIntoImpl,
                              IndexerBwdResultsAndAttrs(IndexerBwdOperands()
                                                            .Arg<ffi::Buffer<ffi::S32>>()    // row_ranges
                                                            .Arg<ffi::Buffer<ffi::BF16>>()   // dq_init
                                                            .Arg<ffi::Buffer<ffi::F32>>()    // dw_init
                                                            .Arg<ffi::Buffer<ffi::F32>>()),  // dk_init
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSparseMlaFwdInto, SparseMlaFwdIntoImpl,
                              SparseMlaFwdResultsAndAttrs(SparseMlaFwdOperands()
                                                              .Arg<ffi::Buffer<ffi::S32>>()    // row_ranges
                                                              .Arg<ffi::Buffer<ffi::BF16>>()   // out_init
                                                              .Arg<ffi::Buffer<ffi::F32>>()),  // lse_init
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSparseMlaBwdInto, SparseMlaBwdIntoImpl,
                              SparseMlaBwdResultsAndAttrs(SparseMlaBwdOperands()
                                                              .Arg<ffi::Buffer<ffi::BF16>>()   // dq_init
                                                              .Arg<ffi::Buffer<ffi::F32>>()),  // dkv_init
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace attn_dist
