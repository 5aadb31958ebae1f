// The indexer_topk op's XLA FFI handler: re-validate what Python checked at
// trace time, then launch. Errors are returned as ffi::Error, never aborts; no
// host synchronisation and no allocation, so XLA may capture the call in a
// CUDA graph.
#include "ffi.h"

#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "../common/ffi_checks.h"
#include "params.h"
#include "variants.h"

namespace attn_dist {
namespace {

// The element types the kernel reads: bf16, or float8 e4m3 (both operands alike).
bool KernelElementType(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F8E4M3FN; }

ffi::Error IndexerTopkImpl(cudaStream_t stream, ffi::AnyBuffer index_q, ffi::AnyBuffer index_k,
                           ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::F32> index_k_scale,
                           ffi::Buffer<ffi::S32> q_start, OptionalRanges row_ranges,
                           ffi::Result<ffi::Buffer<ffi::S32>> indices, float scale, bool causal, int32_t k_stride) {
  const Checker check{kIndexerTopkTarget};
  if (!KernelElementType(index_q.element_type()) || index_k.element_type() != index_q.element_type())
    return check.Invalid("index_q and index_k must both be bfloat16 or both float8_e4m3fn");
  const auto qd = index_q.dimensions();
  if (qd.size() != 4) return check.Invalid("index_q must be rank 4 [B, S, HI, DI], got " + Shape(qd));
  const int64_t B = qd[0], S = qd[1], HI = qd[2], DI = qd[3];
  const auto kd = index_k.dimensions();
  if (kd.size() != 3) return check.Invalid("index_k must be rank 3 [B, N, DI], got " + Shape(kd));
  const int64_t N = kd[1];
  const auto od = indices->dimensions();
  if (od.size() != 4) return check.Invalid("indices must be rank 4 [B, S, 1, topk], got " + Shape(od));
  const int64_t T = od[3];

  if (!OneOf(DI, kIndexerTopkHeadDims))
    return check.Invalid("the indexer head dim DI must be " + OrList(kIndexerTopkHeadDims) + ", got " +
                         std::to_string(DI));
  const int64_t max_heads = IndexerTopkMaxHeads(int(DI));
  if (HI < 1 || HI > max_heads)
    return check.Invalid("the indexer heads HI must be in [1, " + std::to_string(max_heads) + "] at DI = " +
                         std::to_string(DI) + ", got " + std::to_string(HI));
  if (auto e = check.Shape("index_k", kd, {B, N, DI}, "[B, N, DI]"); e.failure()) return e;
  if (auto e = check.Shape("weights", weights.dimensions(), {B, S, HI}, "[B, S, HI]"); e.failure()) return e;
  if (auto e = check.Shape("index_k_scale", index_k_scale.dimensions(), {B, N}, "[B, N]"); e.failure()) return e;
  if (auto e = check.Shape("q_start", q_start.dimensions(), {B}, "[B]"); e.failure()) return e;
  if (auto e = check.Shape("indices", od, {B, S, 1, T}, "[B, S, 1, topk]"); e.failure()) return e;
  const int32_t* ranges = nullptr;
  if (auto e = CheckRowRanges(check, row_ranges, B, S, &ranges); e.failure()) return e;
  if (!(std::isfinite(scale) && scale > 0.f))
    return check.Invalid("scale must be finite and > 0, got " + std::to_string(scale));
  if (k_stride < 1) return check.Invalid("k_stride must be >= 1, got " + std::to_string(k_stride));
  if (auto e = CheckProblemSize(check, S, N, T, B * S, "B * S"); e.failure()) return e;  // T: topk
  if (B * S * T == 0) return ffi::Error::Success();  // no output element, no launch
  if (!Aligned16(index_q.untyped_data()) ||
      (N > 0 && !(Aligned16(index_k.untyped_data()) && Aligned16(index_k_scale.typed_data()))))
    return check.Invalid("index_q, index_k and index_k_scale must be 16-byte aligned");

  IndexerTopkParams p{};
  p.batch = int(B);
  p.s_q = int(S);
  p.s_kv = int(N);
  p.h_idx = int(HI);
  p.d_idx = int(DI);
  p.topk = int(T);
  p.causal = causal;
  p.k_stride = k_stride;
  p.scale = scale;
  p.float8_inputs = index_q.element_type() == ffi::DataType::F8E4M3FN;
  p.index_q = index_q.untyped_data();
  p.index_k = index_k.untyped_data();
  p.weights = weights.typed_data();
  p.index_k_scale = index_k_scale.typed_data();
  p.q_start = q_start.typed_data();
  p.row_ranges = ranges;
  p.indices = indices->typed_data();

  const char* detail = "";
  return check.Launched(run_indexer_topk(p, stream, &detail), detail);
}

}  // namespace

// The row ranges are an optional last operand, as in the other ops.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerTopk, IndexerTopkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // index_q: BF16 or F8E4M3FN
                                  .Arg<ffi::AnyBuffer>()          // index_k: as index_q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // weights
                                  .Arg<ffi::Buffer<ffi::F32>>()   // index_k_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_start
                                  .OptionalArg<ffi::Buffer<ffi::S32>>()  // row_ranges
                                  .Ret<ffi::Buffer<ffi::S32>>()   // indices
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("k_stride"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace attn_dist
