// XLA FFI handlers: re-validate what Python checked at trace time, then launch.
// Errors are returned as ffi::Error, never aborts; no host synchronisation and
// no allocation, so XLA may capture the call in a CUDA graph.
#include "ffi.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <cuda_runtime_api.h>

#include "params.h"

namespace ffi = xla::ffi;

namespace attn_dist {
namespace {

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_attn_dist_fwd: " + msg);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error CheckShape(const char* name, ffi::Span<const int64_t> got, std::initializer_list<int64_t> want,
                      const char* layout) {
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = got[i] == want.begin()[i];
  if (ok) return ffi::Error::Success();
  std::string w = "[";
  size_t i = 0;
  for (int64_t d : want) w += (i++ ? ", " : "") + std::to_string(d);
  return Invalid(std::string(name) + " must have shape " + layout + " = " + w + "], got " + Shape(got));
}

ffi::Error AttnDistFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                           ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::S32> q_start,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, bool causal, int32_t k_stride,
                           bool lse_base_e) {
  const auto qd = q.dimensions();
  if (qd.size() != 4) return Invalid("q must be rank 4 [B, S, H, D], got " + Shape(qd));
  const int64_t B = qd[0], S = qd[1], H = qd[2], D = qd[3];
  const auto kd = k.dimensions();
  if (kd.size() != 4) return Invalid("k must be rank 4 [B, N, 1, D], got " + Shape(kd));
  const int64_t N = kd[1];
  const auto id = indices.dimensions();
  if (id.size() != 4) return Invalid("indices must be rank 4 [B, S, 1, T], got " + Shape(id));
  const int64_t T = id[3];
  const int64_t G = (H + kHeadsPerGroup - 1) / kHeadsPerGroup;

  if (D != 512 && D != 576) return Invalid("the head dim D must be 512 or 576, got " + std::to_string(D));
  if (H < 1) return Invalid("H must be >= 1, got " + std::to_string(H));
  if (auto e = CheckShape("k", kd, {B, N, 1, D}, "[B, N, 1, D]"); e.failure()) return e;
  if (auto e = CheckShape("indices", id, {B, S, 1, T}, "[B, S, 1, T]"); e.failure()) return e;
  if (auto e = CheckShape("lse", lse.dimensions(), {B, S, H}, "[B, S, H]"); e.failure()) return e;
  if (auto e = CheckShape("q_start", q_start.dimensions(), {B}, "[B]"); e.failure()) return e;
  if (auto e = CheckShape("out", out->dimensions(), {B, G, S, T}, "[B, G, S, T]"); e.failure()) return e;
  if (!(std::isfinite(sm_scale) && sm_scale > 0.f))
    return Invalid("sm_scale must be finite and > 0, got " + std::to_string(sm_scale));
  if (k_stride < 1) return Invalid("k_stride must be >= 1, got " + std::to_string(k_stride));

  if (out->element_count() == 0) return ffi::Error::Success();  // nothing to write, no launch

  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  if (S > kIntMax || N > kIntMax || T > kIntMax || B * S * G > kIntMax)
    return Invalid("problem too large: B * S * G, S, N and T must be < 2^31");
  if (!Aligned16(q.untyped_data()) || !Aligned16(k.untyped_data()))
    return Invalid("q and k must be 16-byte aligned");

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
  p.out = out->typed_data();

  const char* detail = "";
  switch (run_attn_dist(p, stream, &detail)) {
    case LaunchStatus::kOk: return ffi::Error::Success();
    case LaunchStatus::kUnsupportedDim: return Invalid(detail);
    case LaunchStatus::kTensorMapError: return ffi::Error::Internal(std::string("jax_attn_dist_fwd: ") + detail);
    case LaunchStatus::kLaunchError:
      return ffi::Error::Internal(std::string("jax_attn_dist_fwd: kernel launch failed: ") + detail);
  }
  return ffi::Error::Internal("jax_attn_dist_fwd: unknown launch status");
}

ffi::Error AttnDistFwdIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                               ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse,
                               ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::F32> out_init,
                               ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, bool causal,
                               int32_t k_stride, bool lse_base_e) {
  if (out_init.untyped_data() != out->untyped_data())
    return Invalid("out_init must be aliased to the output (input_output_aliases={5: 0})");
  return AttnDistFwdImpl(stream, q, k, indices, lse, q_start, out, sm_scale, causal, k_stride, lse_base_e);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttnDistFwd, AttnDistFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // q
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k
                                  .Arg<ffi::Buffer<ffi::S32>>()   // indices
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lse
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_start
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("k_stride")
                                  .Attr<bool>("lse_base_e"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttnDistFwdInto, AttnDistFwdIntoImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // q
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k
                                  .Arg<ffi::Buffer<ffi::S32>>()   // indices
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lse
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_start
                                  .Arg<ffi::Buffer<ffi::F32>>()   // out_init (aliased to out)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("k_stride")
                                  .Attr<bool>("lse_base_e"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace attn_dist
