// The attn_dist op's XLA FFI handler: re-validate what Python checked at trace
// time, then launch. Errors are returned as ffi::Error, never aborts; no host
// synchronisation and no allocation, so XLA may capture the calls in CUDA
// graphs.
#include "ffi.h"

#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "params.h"
#include "variants.h"

namespace attn_dist {

ffi::Error AttnDistFwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                           ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse,
                           ffi::Buffer<ffi::S32> q_start, OptionalRanges row_ranges,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, bool causal, int32_t k_stride,
                           bool lse_base_e) {
  const Checker check{target};
  const auto qd = q.dimensions();
  if (qd.size() != 4) return check.Invalid("q must be rank 4 [B, S, H, D], got " + Shape(qd));
  const int64_t B = qd[0], S = qd[1], H = qd[2], D = qd[3];
  const auto kd = k.dimensions();
  if (kd.size() != 4) return check.Invalid("k must be rank 4 [B, N, 1, D], got " + Shape(kd));
  const int64_t N = kd[1];
  const auto id = indices.dimensions();
  if (id.size() != 4) return check.Invalid("indices must be rank 4 [B, S, 1, T], got " + Shape(id));
  const int64_t T = id[3];
  const int64_t G = (H + dist::kHeadsPerGroup - 1) / dist::kHeadsPerGroup;

  if (!OneOf(D, kAttnDistHeadDims))
    return check.Invalid("the head dim D must be " + OrList(kAttnDistHeadDims) + ", got " + std::to_string(D));
  if (H < 1) return check.Invalid("H must be >= 1, got " + std::to_string(H));
  if (auto e = check.Shape("k", kd, {B, N, 1, D}, "[B, N, 1, D]"); e.failure()) return e;
  if (auto e = check.Shape("indices", id, {B, S, 1, T}, "[B, S, 1, T]"); e.failure()) return e;
  if (auto e = check.Shape("lse", lse.dimensions(), {B, S, H}, "[B, S, H]"); e.failure()) return e;
  if (auto e = check.Shape("q_start", q_start.dimensions(), {B}, "[B]"); e.failure()) return e;
  const int32_t* ranges = nullptr;
  if (auto e = CheckRowRanges(check, row_ranges, B, S, &ranges); e.failure()) return e;
  if (auto e = check.Shape("out", out->dimensions(), {B, G, S, T}, "[B, G, S, T]"); e.failure()) return e;
  // sm_scale * log2(e) in float32, the kernel's scale, must stay finite too.
  if (!(std::isfinite(sm_scale) && sm_scale > 0.f && std::isfinite(float(double(sm_scale) * 1.4426950408889634))))
    return check.Invalid("sm_scale must be finite and > 0 (also times log2(e) in float32), got " +
                         std::to_string(sm_scale));
  if (k_stride < 1) return check.Invalid("k_stride must be >= 1, got " + std::to_string(k_stride));

  if (out->element_count() == 0) return ffi::Error::Success();  // nothing to write, no launch

  if (auto e = CheckProblemSize(check, S, N, T, B * S * G, "B * S * G"); e.failure()) return e;
  if (!Aligned16(q.untyped_data()) || !Aligned16(k.untyped_data()))
    return check.Invalid("q and k must be 16-byte aligned");

  AttnDistParams p{};
  p.batch = int(B);
  p.s_q = int(S);
  p.s_kv = int(N);
  p.h_q = int(H);
  p.d_qk = int(D);
  p.topk = int(T);
  p.num_groups = int(G);
  p.causal = causal;
  p.lse_base_e = lse_base_e;
  p.k_stride = k_stride;
  p.scale_log2 = float(double(sm_scale) * 1.4426950408889634);  // log2(e)
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.indices = indices.typed_data();
  p.lse = lse.typed_data();
  p.q_start = q_start.typed_data();
  p.row_ranges = ranges;
  p.out = out->typed_data();

  const char* detail = "";
  return check.Launched(run_attn_dist(p, stream, &detail), detail);
}

namespace {

ffi::Error AttnDistFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                           ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::S32> q_start,
                           OptionalRanges row_ranges,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, bool causal, int32_t k_stride,
                           bool lse_base_e) {
  return AttnDistFwdCall(kAttnDistFwdTarget, stream, q, k, indices, lse, q_start, row_ranges, out, sm_scale, causal,
                         k_stride, lse_base_e);
}

}  // namespace

// SPEC §6's row ranges are an optional last operand, so that calls exported
// before it existed (one operand fewer) still run.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttnDistFwd, AttnDistFwdImpl,
                              AttnDistResultsAndAttrs(AttnDistOperands().OptionalArg<ffi::Buffer<ffi::S32>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace attn_dist
