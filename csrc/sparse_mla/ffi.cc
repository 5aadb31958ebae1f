// The sparse_mla op's XLA FFI handlers (forward, backward): re-validate what
// Python checked at trace time, then launch. Errors are returned as ffi::Error, never aborts;
// no host synchronisation and no allocation, so XLA may capture the calls in
// CUDA graphs.
#include "ffi.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "../common/ffi_checks.h"
#include "../common/fixed_point_limbs.cuh"
#include "params.h"
#include "variants.h"

namespace attn_dist {

namespace {

constexpr int64_t kKernelDv = 512;

// What both handlers take first (q, kv, indices, q_start, row_ranges) and the
// attributes they share, checked; the sizes of the problem.
struct RowProblem {
  int64_t B, S, H, D, N, T;
  const int32_t* ranges;
};

ffi::Error CheckRowOperands(const Checker& check, const ffi::Buffer<ffi::BF16>& q, const ffi::Buffer<ffi::BF16>& kv,
                            const ffi::Buffer<ffi::S32>& indices, const ffi::Buffer<ffi::S32>& q_start,
                            const OptionalRanges& row_ranges, float sm_scale, int32_t k_stride, RowProblem* r) {
  const auto qd = q.dimensions();
  if (qd.size() != 4) return check.Invalid("q must be rank 4 [B, S, H, D], got " + Shape(qd));
  r->B = qd[0], r->S = qd[1], r->H = qd[2], r->D = qd[3];
  const auto kd = kv.dimensions();
  if (kd.size() != 4) return check.Invalid("kv must be rank 4 [B, N, 1, D], got " + Shape(kd));
  r->N = kd[1];
  const auto id = indices.dimensions();
  if (id.size() != 4) return check.Invalid("indices must be rank 4 [B, S, 1, T], got " + Shape(id));
  r->T = id[3];
  const int64_t B = r->B, S = r->S;
  if (!OneOf(r->D, kSparseMlaHeadDims))
    return check.Invalid("the head dim D must be " + OrList(kSparseMlaHeadDims) + ", got " + std::to_string(r->D));
  if (auto e = check.Shape("kv", kd, {B, r->N, 1, r->D}, "[B, N, 1, D]"); e.failure()) return e;
  if (auto e = check.Shape("indices", id, {B, S, 1, r->T}, "[B, S, 1, T]"); e.failure()) return e;
  if (auto e = check.Shape("q_start", q_start.dimensions(), {B}, "[B]"); e.failure()) return e;
  if (auto e = CheckRowRanges(check, row_ranges, B, S, &r->ranges); e.failure()) return e;
  // sm_scale * log2(e) in float32, the kernels' scale, must stay finite too.
  if (!(std::isfinite(sm_scale) && sm_scale > 0.f && std::isfinite(float(double(sm_scale) * 1.4426950408889634))))
    return check.Invalid("sm_scale must be finite and > 0 (also times log2(e) in float32), got " +
                         std::to_string(sm_scale));
  if (k_stride < 1) return check.Invalid("k_stride must be >= 1, got " + std::to_string(k_stride));
  return ffi::Error::Success();
}

// The launch limits both kernels share (one CTA per row and 64-head tile).
ffi::Error CheckLaunchSize(const Checker& check, const RowProblem& r) {
  const int64_t head_tiles = (r.H + 63) / 64;
  if (r.H > kIntMax) return check.Invalid("problem too large: H must be < 2^31, got " + std::to_string(r.H));
  return CheckProblemSize(check, r.S, r.N, r.T, r.B * r.S * head_tiles, "B * S * ceil(H / 64)");
}

// The fields SparseMlaFwdParams and SparseMlaBwdParams share.
template <class Params>
void SetRowParams(Params& p, const RowProblem& r, const ffi::Buffer<ffi::BF16>& q, const ffi::Buffer<ffi::BF16>& kv,
                  const ffi::Buffer<ffi::S32>& indices, const ffi::Buffer<ffi::S32>& q_start, float sm_scale,
                  bool causal, int32_t k_stride, bool lse_base_e) {
  p.batch = int(r.B);
  p.s_q = int(r.S);
  p.s_kv = int(r.N);
  p.h_q = int(r.H);
  p.d_qk = int(r.D);
  p.d_v = int(kKernelDv);
  p.topk = int(r.T);
  p.causal = causal;
  p.lse_base_e = lse_base_e;
  p.k_stride = k_stride;
  p.scale_log2 = float(double(sm_scale) * 1.4426950408889634);  // log2(e)
  p.q = q.untyped_data();
  p.kv = kv.untyped_data();
  p.indices = indices.typed_data();
  p.q_start = q_start.typed_data();
  p.row_ranges = r.ranges;
}

}  // namespace

ffi::Error SparseMlaFwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                            ffi::Buffer<ffi::BF16> kv, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                            OptionalRanges row_ranges, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale, bool causal, int32_t k_stride,
                            bool lse_base_e) {
  const Checker check{target};
  RowProblem r{};
  if (auto e = CheckRowOperands(check, q, kv, indices, q_start, row_ranges, sm_scale, k_stride, &r); e.failure())
    return e;
  if (auto e = check.Shape("out", out->dimensions(), {r.B, r.S, r.H, kKernelDv}, "[B, S, H, d_v = 512]");
      e.failure())
    return e;
  if (auto e = check.Shape("lse", lse->dimensions(), {r.B, r.S, r.H}, "[B, S, H]"); e.failure()) return e;

  if (lse->element_count() == 0) return ffi::Error::Success();  // nothing to write, no launch

  if (auto e = CheckLaunchSize(check, r); e.failure()) return e;
  // (kv only where it has a key: an empty buffer's pointer need not be aligned)
  if (!Aligned16(q.untyped_data()) || (r.N > 0 && !Aligned16(kv.untyped_data())) || !Aligned16(out->untyped_data()))
    return check.Invalid("q, kv and out must be 16-byte aligned");

  SparseMlaFwdParams p{};
  SetRowParams(p, r, q, kv, indices, q_start, sm_scale, causal, k_stride, lse_base_e);
  p.out = out->untyped_data();
  p.lse = lse->typed_data();

  const char* detail = "";
  return check.Launched(run_sparse_mla_fwd(p, stream, &detail), detail);
}

namespace {

int64_t AlignUp(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// The backward's workspace, as jax_attn_dist/ops/sparse_mla/contract.py's
// bwd_workspace_bytes lays it out: the per-head row terms (float32 [B, S,
// H]); deterministic mode: then the fixed-point sums (int64 [B, N, D]) and
// the scale words (uint32 [B] max |kv|, then uint32 [B] bounds, as float
// bits); each part on a 256-byte boundary.
struct BwdWorkspace {
  int64_t row_terms_bytes, fixed_bytes, total_bytes;
  BwdWorkspace(const RowProblem& r, bool deterministic) {
    row_terms_bytes = AlignUp(r.B * r.S * r.H * 4);
    fixed_bytes = deterministic ? AlignUp(r.B * r.N * r.D * 8) : 0;
    total_bytes = row_terms_bytes + fixed_bytes + (deterministic ? AlignUp(r.B * 2 * 4) : 0);
  }
};

// The sharded deterministic backward's main call's workspace (contract.py's
// bwd_fixed_workspace_bytes): the fixed-point sums (int64 [B, N, D]), then
// the flag words (uint32 [B]).
struct BwdFixedWorkspace {
  int64_t fixed_bytes, total_bytes;
  explicit BwdFixedWorkspace(const RowProblem& r) {
    fixed_bytes = AlignUp(r.B * r.N * r.D * 8);
    total_bytes = fixed_bytes + AlignUp(r.B * 4);
  }
};

// The nine operands every backward handler takes, checked; the sizes.
ffi::Error CheckBwdOperands(const Checker& check, const ffi::Buffer<ffi::BF16>& q, const ffi::Buffer<ffi::BF16>& kv,
                            const ffi::Buffer<ffi::S32>& indices, const ffi::Buffer<ffi::S32>& q_start,
                            const ffi::Buffer<ffi::S32>& row_ranges, const ffi::Buffer<ffi::BF16>& out,
                            const ffi::Buffer<ffi::F32>& lse, const ffi::Buffer<ffi::BF16>& dout,
                            const ffi::Buffer<ffi::F32>& dlse, float sm_scale, int32_t k_stride, RowProblem* r) {
  if (auto e = CheckRowOperands(check, q, kv, indices, q_start, OptionalRanges(row_ranges), sm_scale, k_stride, r);
      e.failure())
    return e;
  for (auto [name, dims] : {std::pair{"out", out.dimensions()}, std::pair{"dout", dout.dimensions()}})
    if (auto e = check.Shape(name, dims, {r->B, r->S, r->H, kKernelDv}, "[B, S, H, d_v = 512]"); e.failure())
      return e;
  for (auto [name, dims] : {std::pair{"lse", lse.dimensions()}, std::pair{"dlse", dlse.dimensions()}})
    if (auto e = check.Shape(name, dims, {r->B, r->S, r->H}, "[B, S, H]"); e.failure()) return e;
  return ffi::Error::Success();
}

// The launch-size and alignment checks of a backward with rows to run.
ffi::Error CheckBwdLaunch(const Checker& check, const RowProblem& r, std::initializer_list<const void*> pointers) {
  if (auto e = CheckLaunchSize(check, r); e.failure()) return e;
  for (const void* ptr : pointers)
    if (ptr != nullptr && !Aligned16(ptr))
      return check.Invalid("q, kv, out, dout, the gradients and the workspace must be 16-byte aligned");
  return ffi::Error::Success();
}

SparseMlaBwdParams BwdParams(const RowProblem& r, const ffi::Buffer<ffi::BF16>& q, const ffi::Buffer<ffi::BF16>& kv,
                             const ffi::Buffer<ffi::S32>& indices, const ffi::Buffer<ffi::S32>& q_start,
                             const ffi::Buffer<ffi::BF16>& out, const ffi::Buffer<ffi::F32>& lse,
                             const ffi::Buffer<ffi::BF16>& dout, const ffi::Buffer<ffi::F32>& dlse, float sm_scale,
                             bool causal, int32_t k_stride, bool lse_base_e) {
  SparseMlaBwdParams p{};
  SetRowParams(p, r, q, kv, indices, q_start, sm_scale, causal, k_stride, lse_base_e);
  p.sm_scale = sm_scale;
  p.out = out.untyped_data();
  p.lse = lse.typed_data();
  p.dout = dout.untyped_data();
  p.dlse = dlse.typed_data();
  p.scale_rows = r.S;
  return p;
}

ffi::Error Zero(const Checker& check, void* ptr, size_t bytes, cudaStream_t stream) {
  if (bytes == 0 || cudaMemsetAsync(ptr, 0, bytes, stream) == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(check.target) + ": cudaMemsetAsync failed");
}

}  // namespace

ffi::Error SparseMlaBwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                            ffi::Buffer<ffi::BF16> kv, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                            ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::BF16> out, ffi::Buffer<ffi::F32> lse,
                            ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::F32> dlse,
                            ffi::Result<ffi::Buffer<ffi::BF16>> dq, ffi::Result<ffi::Buffer<ffi::F32>> dkv,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, float sm_scale, bool causal,
                            int32_t k_stride, bool lse_base_e, bool deterministic) {
  const Checker check{target};
  RowProblem r{};
  if (auto e = CheckBwdOperands(check, q, kv, indices, q_start, row_ranges, out, lse, dout, dlse, sm_scale, k_stride,
                                &r);
      e.failure())
    return e;
  if (auto e = check.Shape("dq", dq->dimensions(), {r.B, r.S, r.H, r.D}, "[B, S, H, D]"); e.failure()) return e;
  if (auto e = check.Shape("dkv", dkv->dimensions(), {r.B, r.N, 1, r.D}, "[B, N, 1, D]"); e.failure()) return e;
  const BwdWorkspace layout(r, deterministic);
  if (int64_t(workspace->size_bytes()) < layout.total_bytes)
    return check.Invalid("workspace must hold " + std::to_string(layout.total_bytes) + " bytes, got " +
                         std::to_string(workspace->size_bytes()));

  if (dq->element_count() == 0 && dkv->element_count() == 0) return ffi::Error::Success();  // no launch
  // no query rows: no gradient reaches kv
  if (dq->element_count() == 0) return Zero(check, dkv->untyped_data(), dkv->size_bytes(), stream);

  const bool keys = r.N > 0;  // an empty kv or dkv's pointer need not be aligned
  if (auto e = CheckBwdLaunch(check, r,
                              {q.untyped_data(), keys ? kv.untyped_data() : nullptr, out.untyped_data(),
                               dout.untyped_data(), dq->untyped_data(), keys ? dkv->untyped_data() : nullptr,
                               workspace->untyped_data()});
      e.failure())
    return e;

  SparseMlaBwdParams p = BwdParams(r, q, kv, indices, q_start, out, lse, dout, dlse, sm_scale, causal, k_stride,
                                   lse_base_e);
  p.dq = dq->untyped_data();
  p.dkv = dkv->typed_data();
  auto* base = static_cast<char*>(workspace->untyped_data());
  p.row_delta = reinterpret_cast<float*>(base);
  if (deterministic) {
    p.dkv_fixed = reinterpret_cast<long long*>(base + layout.row_terms_bytes);
    auto* words = reinterpret_cast<unsigned int*>(base + layout.row_terms_bytes + layout.fixed_bytes);
    p.kv_max_bits = words;
    p.bound_bits = words + r.B;
    p.flag_bits = p.bound_bits;  // one call: a flagged term raises the bound itself
  }

  const char* detail = "";
  return check.Launched(run_sparse_mla_bwd(p, stream, &detail), detail);
}

namespace {

ffi::Error SparseMlaFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> kv,
                            ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start, OptionalRanges row_ranges,
                            ffi::Result<ffi::Buffer<ffi::BF16>> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                            float sm_scale, bool causal, int32_t k_stride, bool lse_base_e) {
  return SparseMlaFwdCall(kSparseMlaFwdTarget, stream, q, kv, indices, q_start, row_ranges, out, lse, sm_scale,
                          causal, k_stride, lse_base_e);
}

ffi::Error SparseMlaBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> kv,
                            ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                            ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::BF16> out, ffi::Buffer<ffi::F32> lse,
                            ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::F32> dlse,
                            ffi::Result<ffi::Buffer<ffi::BF16>> dq, ffi::Result<ffi::Buffer<ffi::F32>> dkv,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, float sm_scale, bool causal,
                            int32_t k_stride, bool lse_base_e, bool deterministic) {
  return SparseMlaBwdCall(kSparseMlaBwdTarget, stream, q, kv, indices, q_start, row_ranges, out, lse, dout, dlse, dq,
                          dkv, workspace, sm_scale, causal, k_stride, lse_base_e, deterministic);
}

// The sharded deterministic backward, first call: the row terms and the
// scale words [2, B] (max |kv|, then the rows' largest bound, as float bits).
ffi::Error SparseMlaBwdBoundImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> kv,
                                 ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                                 ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::BF16> out,
                                 ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::F32> dlse,
                                 ffi::Result<ffi::Buffer<ffi::F32>> row_delta,
                                 ffi::Result<ffi::Buffer<ffi::S32>> scale_words, float sm_scale, bool causal,
                                 int32_t k_stride, bool lse_base_e) {
  const Checker check{kSparseMlaBwdBoundTarget};
  RowProblem r{};
  if (auto e = CheckBwdOperands(check, q, kv, indices, q_start, row_ranges, out, lse, dout, dlse, sm_scale, k_stride,
                                &r);
      e.failure())
    return e;
  if (auto e = check.Shape("row_delta", row_delta->dimensions(), {r.B, r.S, r.H}, "[B, S, H]"); e.failure()) return e;
  if (auto e = check.Shape("scale_words", scale_words->dimensions(), {2, r.B}, "[2, B]"); e.failure()) return e;
  // No rows: no bound (and nothing for the later calls to scale).
  if (row_delta->element_count() == 0)
    return Zero(check, scale_words->untyped_data(), scale_words->size_bytes(), stream);
  if (auto e = CheckBwdLaunch(check, r, {q.untyped_data(), kv.untyped_data(), out.untyped_data(), dout.untyped_data()});
      e.failure())
    return e;

  SparseMlaBwdParams p = BwdParams(r, q, kv, indices, q_start, out, lse, dout, dlse, sm_scale, causal, k_stride,
                                   lse_base_e);
  p.row_delta = row_delta->typed_data();
  auto* words = reinterpret_cast<unsigned int*>(scale_words->typed_data());
  p.kv_max_bits = words;
  p.bound_bits = words + r.B;
  const char* detail = "";
  return check.Launched(run_sparse_mla_bwd_bound(p, stream, &detail), detail);
}

// The sharded deterministic backward, second call: given the row terms and
// every shard's largest scale words, dq and this shard's fixed-point sums as
// limbs [3, B, N, 1, D] and flags [B]; the scale chosen for scale_rows rows.
ffi::Error SparseMlaBwdFixedImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> kv,
                                 ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> q_start,
                                 ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::BF16> out,
                                 ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::F32> dlse,
                                 ffi::Buffer<ffi::F32> row_delta, ffi::Buffer<ffi::S32> scale_words,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> dq, ffi::Result<ffi::Buffer<ffi::S32>> limbs,
                                 ffi::Result<ffi::Buffer<ffi::S32>> flags, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                                 float sm_scale, bool causal, int32_t k_stride, bool lse_base_e, int64_t scale_rows) {
  const Checker check{kSparseMlaBwdFixedTarget};
  RowProblem r{};
  if (auto e = CheckBwdOperands(check, q, kv, indices, q_start, row_ranges, out, lse, dout, dlse, sm_scale, k_stride,
                                &r);
      e.failure())
    return e;
  if (auto e = check.Shape("row_delta", row_delta.dimensions(), {r.B, r.S, r.H}, "[B, S, H]"); e.failure()) return e;
  if (auto e = check.Shape("scale_words", scale_words.dimensions(), {2, r.B}, "[2, B]"); e.failure()) return e;
  if (auto e = check.Shape("dq", dq->dimensions(), {r.B, r.S, r.H, r.D}, "[B, S, H, D]"); e.failure()) return e;
  if (auto e = check.Shape("limbs", limbs->dimensions(), {3, r.B, r.N, 1, r.D}, "[3, B, N, 1, D]"); e.failure())
    return e;
  if (auto e = check.Shape("flags", flags->dimensions(), {r.B}, "[B]"); e.failure()) return e;
  if (scale_rows < r.S || scale_rows > kMaxScaleRows)
    return check.Invalid("scale_rows must be at least this shard's rows S = " + std::to_string(r.S) +
                         " and at most 2^40, got " + std::to_string(scale_rows));
  const BwdFixedWorkspace layout(r);
  if (int64_t(workspace->size_bytes()) < layout.total_bytes)
    return check.Invalid("workspace must hold " + std::to_string(layout.total_bytes) + " bytes, got " +
                         std::to_string(workspace->size_bytes()));
  if (dq->element_count() == 0) {  // no query rows: no gradient reaches kv
    if (auto e = Zero(check, limbs->untyped_data(), limbs->size_bytes(), stream); e.failure()) return e;
    return Zero(check, flags->untyped_data(), flags->size_bytes(), stream);
  }
  if (auto e = CheckBwdLaunch(check, r,
                              {q.untyped_data(), kv.untyped_data(), out.untyped_data(), dout.untyped_data(),
                               dq->untyped_data(), workspace->untyped_data()});
      e.failure())
    return e;

  SparseMlaBwdParams p = BwdParams(r, q, kv, indices, q_start, out, lse, dout, dlse, sm_scale, causal, k_stride,
                                   lse_base_e);
  p.dq = dq->untyped_data();
  p.row_delta = const_cast<float*>(row_delta.typed_data());  // read only: the row terms were formed before
  // read only here: the scale words are every shard's maximum
  auto* words = reinterpret_cast<unsigned int*>(const_cast<int32_t*>(scale_words.typed_data()));
  p.kv_max_bits = words;
  p.bound_bits = words + r.B;
  auto* base = static_cast<char*>(workspace->untyped_data());
  p.dkv_fixed = reinterpret_cast<long long*>(base);
  p.flag_bits = reinterpret_cast<unsigned int*>(base + layout.fixed_bytes);
  p.scale_rows = scale_rows;
  const char* detail = "";
  return check.Launched(
      run_sparse_mla_bwd_fixed(p, limbs->typed_data(), flags->typed_data(), stream, &detail), detail);
}

}  // namespace


XLA_FFI_DEFINE_HANDLER_SYMBOL(kSparseMlaFwd, SparseMlaFwdImpl,
                              SparseMlaFwdResultsAndAttrs(
                                  SparseMlaFwdOperands().OptionalArg<ffi::Buffer<ffi::S32>>()),  // row_ranges
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSparseMlaBwd, SparseMlaBwdImpl, SparseMlaBwdResultsAndAttrs(SparseMlaBwdOperands()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSparseMlaBwdBound, SparseMlaBwdBoundImpl,
                              SparseMlaAttrs(SparseMlaBwdOperands()
                                                 .Ret<ffi::Buffer<ffi::F32>>()    // row_delta
                                                 .Ret<ffi::Buffer<ffi::S32>>()),  // scale_words
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kSparseMlaBwdFixed, SparseMlaBwdFixedImpl,
                              SparseMlaAttrs(SparseMlaBwdOperands()
                                                 .Arg<ffi::Buffer<ffi::F32>>()   // row_delta
                                                 .Arg<ffi::Buffer<ffi::S32>>()   // scale_words
                                                 .Ret<ffi::Buffer<ffi::BF16>>()  // dq
                                                 .Ret<ffi::Buffer<ffi::S32>>()   // limbs
                                                 .Ret<ffi::Buffer<ffi::S32>>()   // flags
                                                 .Ret<ffi::Buffer<ffi::U8>>())   // workspace
                                  .Attr<int64_t>("scale_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace attn_dist
