// XLA FFI handlers: re-validate what Python checked at trace time, then launch.
// Errors are returned as ffi::Error, never aborts; no host synchronisation and
// no allocation, so XLA may capture the calls in CUDA graphs.
#include "ffi.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "params.h"

namespace ffi = xla::ffi;

namespace attn_dist {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Errors name the FFI target they come from.
struct Checker {
  const char* target;

  ffi::Error Invalid(const std::string& msg) const {
    return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
  }

  ffi::Error Shape(const char* name, ffi::Span<const int64_t> got, std::initializer_list<int64_t> want,
                   const char* layout) const {
    bool ok = got.size() == want.size();
    for (size_t i = 0; ok && i < want.size(); ++i) ok = got[i] == want.begin()[i];
    if (ok) return ffi::Error::Success();
    std::string w = "[";
    size_t i = 0;
    for (int64_t d : want) w += (i++ ? ", " : "") + std::to_string(d);
    return Invalid(std::string(name) + " must have shape " + layout + " = " + w + "], got " +
                   attn_dist::Shape(got));
  }

  ffi::Error Launched(LaunchStatus status, const char* detail) const {
    switch (status) {
      case LaunchStatus::kOk: return ffi::Error::Success();
      case LaunchStatus::kInvalidProblem:
      case LaunchStatus::kUnsupportedDim: return Invalid(detail);
      case LaunchStatus::kTensorMapError: return ffi::Error::Internal(std::string(target) + ": " + detail);
      case LaunchStatus::kLaunchError:
        return ffi::Error::Internal(std::string(target) + ": kernel launch failed: " + detail);
    }
    return ffi::Error::Internal(std::string(target) + ": unknown launch status");
  }
};

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <size_t N>
bool OneOf(int64_t v, const int (&set)[N]) {
  return std::find(set, set + N, v) != set + N;
}

// SPEC §6's per-row ranges (common/slot_validity.cuh): an optional operand
// (absent in calls exported before it existed), int32 [B, S, 3], or
// [B, S, 0] for none; without ranges the kernels apply SPEC §2's rule. Their
// values need no check: the kernels clamp them.
using OptionalRanges = std::optional<ffi::Buffer<ffi::S32>>;

ffi::Error CheckRowRanges(const Checker& check, const OptionalRanges& row_ranges, int64_t B, int64_t S,
                          const int32_t** ranges) {
  *ranges = nullptr;
  if (!row_ranges.has_value()) return ffi::Error::Success();
  const auto rd = row_ranges->dimensions();
  const bool given = rd.size() == 3 && rd[2] == kRowRangeFields;
  if (auto e = check.Shape("row_ranges", rd, {B, S, given ? kRowRangeFields : 0},
                           given ? "[B, S, 3]" : "[B, S, 0] (none) or [B, S, 3]");
      e.failure())
    return e;
  if (given) *ranges = row_ranges->typed_data();
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// attn_dist
// ---------------------------------------------------------------------------

ffi::Error AttnDistFwd(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                       ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::S32> q_start,
                       OptionalRanges row_ranges,
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
  const int64_t G = (H + kHeadsPerGroup - 1) / kHeadsPerGroup;

  if (!OneOf(D, kAttnDistHeadDims)) return check.Invalid("the head dim D must be 512 or 576, got " + std::to_string(D));
  if (H < 1) return check.Invalid("H must be >= 1, got " + std::to_string(H));
  if (auto e = check.Shape("k", kd, {B, N, 1, D}, "[B, N, 1, D]"); e.failure()) return e;
  if (auto e = check.Shape("indices", id, {B, S, 1, T}, "[B, S, 1, T]"); e.failure()) return e;
  if (auto e = check.Shape("lse", lse.dimensions(), {B, S, H}, "[B, S, H]"); e.failure()) return e;
  if (auto e = check.Shape("q_start", q_start.dimensions(), {B}, "[B]"); e.failure()) return e;
  const int32_t* ranges = nullptr;
  if (auto e = CheckRowRanges(check, row_ranges, B, S, &ranges); e.failure()) return e;
  if (auto e = check.Shape("out", out->dimensions(), {B, G, S, T}, "[B, G, S, T]"); e.failure()) return e;
  if (!(std::isfinite(sm_scale) && sm_scale > 0.f))
    return check.Invalid("sm_scale must be finite and > 0, got " + std::to_string(sm_scale));
  if (k_stride < 1) return check.Invalid("k_stride must be >= 1, got " + std::to_string(k_stride));

  if (out->element_count() == 0) return ffi::Error::Success();  // nothing to write, no launch

  if (S > kIntMax || N > kIntMax || T > kIntMax || B * S * G > kIntMax)
    return check.Invalid("problem too large: B * S * G, S, N and T must be < 2^31");
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

ffi::Error AttnDistFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                           ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::S32> q_start,
                           OptionalRanges row_ranges,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, bool causal, int32_t k_stride,
                           bool lse_base_e) {
  return AttnDistFwd(kAttnDistTarget, stream, q, k, indices, lse, q_start, row_ranges, out, sm_scale, causal, k_stride,
                     lse_base_e);
}

ffi::Error AttnDistFwdIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                               ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse,
                               ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> row_ranges,
                               ffi::Buffer<ffi::F32> out_init,
                               ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale, bool causal,
                               int32_t k_stride, bool lse_base_e) {
  if (out_init.untyped_data() != out->untyped_data())
    return Checker{kAttnDistPoisonedTarget}.Invalid(
        "out_init must be aliased to the output (input_output_aliases={6: 0})");
  return AttnDistFwd(kAttnDistPoisonedTarget, stream, q, k, indices, lse, q_start, row_ranges, out, sm_scale, causal,
                     k_stride, lse_base_e);
}

// ---------------------------------------------------------------------------
// indexer_kl forward
// ---------------------------------------------------------------------------

// The operands both indexer targets take, checked once: shapes, DI, HI (at
// most max_heads), scale, k_stride and int32 sizes. On success `dims` holds
// B, S, HI, DI, N, T.
struct IndexerDims {
  int64_t B, S, HI, DI, N, T;
};

ffi::Error CheckIndexerOperands(const Checker& check, const ffi::Buffer<ffi::BF16>& index_q,
                                const ffi::Buffer<ffi::BF16>& index_k, const ffi::Buffer<ffi::F32>& weights,
                                const ffi::Buffer<ffi::S32>& indices, const ffi::Buffer<ffi::F32>& target_dist,
                                const ffi::Buffer<ffi::S32>& q_start, const OptionalRanges& row_ranges,
                                float scale, int32_t k_stride, int64_t max_heads, IndexerDims* dims,
                                const int32_t** ranges) {
  const auto qd = index_q.dimensions();
  if (qd.size() != 4) return check.Invalid("index_q must be rank 4 [B, S, HI, DI], got " + Shape(qd));
  const int64_t B = qd[0], S = qd[1], HI = qd[2], DI = qd[3];
  const auto kd = index_k.dimensions();
  if (kd.size() != 3) return check.Invalid("index_k must be rank 3 [B, N, DI], got " + Shape(kd));
  const int64_t N = kd[1];
  const auto id = indices.dimensions();
  if (id.size() != 4) return check.Invalid("indices must be rank 4 [B, S, 1, T], got " + Shape(id));
  const int64_t T = id[3];

  if (!OneOf(DI, kIndexerHeadDims))
    return check.Invalid("the indexer head dim DI must be 64 or 128, got " + std::to_string(DI));
  if (HI < 1 || HI > max_heads)
    return check.Invalid("the indexer heads HI must be in [1, " + std::to_string(max_heads) + "], got " +
                         std::to_string(HI));
  if (auto e = check.Shape("index_k", kd, {B, N, DI}, "[B, N, DI]"); e.failure()) return e;
  if (auto e = check.Shape("weights", weights.dimensions(), {B, S, HI}, "[B, S, HI]"); e.failure()) return e;
  if (auto e = check.Shape("indices", id, {B, S, 1, T}, "[B, S, 1, T]"); e.failure()) return e;
  if (auto e = check.Shape("target", target_dist.dimensions(), {B, S, T}, "[B, S, T]"); e.failure()) return e;
  if (auto e = check.Shape("q_start", q_start.dimensions(), {B}, "[B]"); e.failure()) return e;
  if (auto e = CheckRowRanges(check, row_ranges, B, S, ranges); e.failure()) return e;
  if (!(std::isfinite(scale) && scale > 0.f))
    return check.Invalid("scale must be finite and > 0, got " + std::to_string(scale));
  if (k_stride < 1) return check.Invalid("k_stride must be >= 1, got " + std::to_string(k_stride));
  if (S > kIntMax || N > kIntMax || T > kIntMax || B * S > kIntMax)
    return check.Invalid("problem too large: B * S, N and T must be < 2^31");
  if (!Aligned16(index_q.untyped_data()) || !Aligned16(index_k.untyped_data()))
    return check.Invalid("index_q and index_k must be 16-byte aligned");
  *dims = IndexerDims{B, S, HI, DI, N, T};
  return ffi::Error::Success();
}

// The problem fields both indexer params structs share.
void FillIndexerProblem(IndexerProblemParams& p, const IndexerDims& d, const ffi::Buffer<ffi::BF16>& index_q,
                        const ffi::Buffer<ffi::BF16>& index_k, const ffi::Buffer<ffi::F32>& weights,
                        const ffi::Buffer<ffi::S32>& indices, const ffi::Buffer<ffi::F32>& target_dist,
                        const ffi::Buffer<ffi::S32>& q_start, const int32_t* ranges, float scale, bool causal,
                        int32_t k_stride) {
  p.batch = int(d.B);
  p.s_q = int(d.S);
  p.s_kv = int(d.N);
  p.h_idx = int(d.HI);
  p.d_idx = int(d.DI);
  p.topk = int(d.T);
  p.causal = causal;
  p.k_stride = k_stride;
  p.scale = scale;
  p.index_q = index_q.untyped_data();
  p.index_k = index_k.untyped_data();
  p.weights = weights.typed_data();
  p.indices = indices.typed_data();
  p.target = target_dist.typed_data();
  p.q_start = q_start.typed_data();
  p.row_ranges = ranges;
}

ffi::Error IndexerFwd(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q,
                      ffi::Buffer<ffi::BF16> index_k, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                      ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                      OptionalRanges row_ranges,
                      ffi::Result<ffi::Buffer<ffi::F32>> kl, ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                      bool causal, int32_t k_stride) {
  const Checker check{target};
  IndexerDims d{};
  const int32_t* ranges = nullptr;
  if (auto e = CheckIndexerOperands(check, index_q, index_k, weights, indices, target_dist, q_start, row_ranges, scale,
                                    k_stride, kIndexerMaxHeads, &d, &ranges);
      e.failure())
    return e;
  if (auto e = check.Shape("kl", kl->dimensions(), {d.B, d.S}, "[B, S]"); e.failure()) return e;
  if (auto e = check.Shape("lse", lse->dimensions(), {d.B, d.S}, "[B, S]"); e.failure()) return e;
  if (d.B * d.S == 0) return ffi::Error::Success();  // no rows, no launch

  IndexerFwdParams p{};
  FillIndexerProblem(p, d, index_q, index_k, weights, indices, target_dist, q_start, ranges, scale, causal,
                     k_stride);
  p.kl = kl->typed_data();
  p.lse = lse->typed_data();

  const char* detail = "";
  return check.Launched(run_indexer_fwd(p, stream, &detail), detail);
}

ffi::Error IndexerFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                          ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                          ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                          OptionalRanges row_ranges,
                          ffi::Result<ffi::Buffer<ffi::F32>> kl, ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                          bool causal, int32_t k_stride) {
  return IndexerFwd(kIndexerFwdTarget, stream, index_q, index_k, weights, indices, target_dist, q_start, row_ranges,
                    kl, lse, scale, causal, k_stride);
}

ffi::Error IndexerFwdIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                              ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                              ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                              ffi::Buffer<ffi::S32> row_ranges, ffi::Buffer<ffi::F32> kl_init,
                              ffi::Buffer<ffi::F32> lse_init,
                              ffi::Result<ffi::Buffer<ffi::F32>> kl, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              float scale, bool causal, int32_t k_stride) {
  if (kl_init.untyped_data() != kl->untyped_data() || lse_init.untyped_data() != lse->untyped_data())
    return Checker{kIndexerFwdPoisonedTarget}.Invalid(
        "kl_init and lse_init must be aliased to the outputs (input_output_aliases={7: 0, 8: 1})");
  return IndexerFwd(kIndexerFwdPoisonedTarget, stream, index_q, index_k, weights, indices, target_dist, q_start,
                    row_ranges, kl, lse, scale, causal, k_stride);
}

// ---------------------------------------------------------------------------
// indexer_kl backward
// ---------------------------------------------------------------------------

ffi::Error IndexerBwd(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q,
                      ffi::Buffer<ffi::BF16> index_k, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                      ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                      OptionalRanges row_ranges, ffi::Buffer<ffi::F32> lse,
                      ffi::Buffer<ffi::F32> g, ffi::Result<ffi::Buffer<ffi::BF16>> d_index_q,
                      ffi::Result<ffi::Buffer<ffi::F32>> d_weights, ffi::Result<ffi::Buffer<ffi::F32>> d_index_k,
                      ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale, bool causal, int32_t k_stride,
                      bool deterministic) {
  const Checker check{target};
  IndexerDims d{};
  const int32_t* ranges = nullptr;
  if (auto e = CheckIndexerOperands(check, index_q, index_k, weights, indices, target_dist, q_start, row_ranges, scale,
                                    k_stride, kIndexerBwdMaxHeads, &d, &ranges);
      e.failure())
    return e;
  const int64_t B = d.B, S = d.S, HI = d.HI, DI = d.DI, N = d.N;
  if (auto e = check.Shape("lse", lse.dimensions(), {B, S}, "[B, S]"); e.failure()) return e;
  if (auto e = check.Shape("g", g.dimensions(), {B, S}, "[B, S]"); e.failure()) return e;
  if (auto e = check.Shape("d_index_q", d_index_q->dimensions(), {B, S, HI, DI}, "[B, S, HI, DI]"); e.failure())
    return e;
  if (auto e = check.Shape("d_weights", d_weights->dimensions(), {B, S, HI}, "[B, S, HI]"); e.failure()) return e;
  if (auto e = check.Shape("d_index_k", d_index_k->dimensions(), {B, N, DI}, "[B, N, DI]"); e.failure()) return e;
  if (!Aligned16(d_index_k->untyped_data())) return check.Invalid("d_index_k must be 16-byte aligned");
  // Deterministic mode's workspace, bytes: the int64 fixed-point sums
  // [B, N, DI] and one int64 word for the rows' bound (fixed_point.cuh);
  // float32 mode uses none.
  const int64_t dk_elems = B * N * DI;
  const int64_t want_ws = deterministic ? (dk_elems + 1) * int64_t(sizeof(int64_t)) : 0;
  if (int64_t(workspace->element_count()) != want_ws)
    return check.Invalid("workspace must be uint8 [" + std::to_string(want_ws) + "] (" +
                         (deterministic ? "8 * (B * N * DI + 1) for deterministic=True"
                                        : "empty for deterministic=False") +
                         "), got " + attn_dist::Shape(workspace->dimensions()));
  if (deterministic && !Aligned16(workspace->untyped_data())) return check.Invalid("workspace must be 16-byte aligned");

  // The sums start from zero: d_index_k in float32 mode, the workspace in
  // deterministic mode (whose last kernel writes all of d_index_k), and
  // d_index_k when there are no rows. Memset nodes: no allocation, no
  // synchronisation, capturable.
  const bool fixed = deterministic && B * S > 0;
  void* const zeroed = fixed ? workspace->untyped_data() : d_index_k->untyped_data();
  const size_t zeroed_bytes = fixed ? size_t(want_ws) : size_t(dk_elems) * sizeof(float);
  if (zeroed_bytes > 0) {
    const cudaError_t err = cudaMemsetAsync(zeroed, 0, zeroed_bytes, stream);
    if (err != cudaSuccess)
      return ffi::Error::Internal(std::string(target) + ": clearing the d_index_k sums failed: " +
                                  cudaGetErrorString(err));
  }
  if (B * S == 0) return ffi::Error::Success();  // no rows, no launch

  IndexerBwdParams p{};
  FillIndexerProblem(p, d, index_q, index_k, weights, indices, target_dist, q_start, ranges, scale, causal,
                     k_stride);
  p.lse = lse.typed_data();
  p.g = g.typed_data();
  p.d_index_q = d_index_q->untyped_data();
  p.d_weights = d_weights->typed_data();
  p.d_index_k = d_index_k->typed_data();
  if (fixed) {
    p.dk_fixed = static_cast<long long*>(workspace->untyped_data());
    p.bound_bits = reinterpret_cast<unsigned int*>(p.dk_fixed + dk_elems);
  }

  const char* detail = "";
  return check.Launched(run_indexer_bwd(p, stream, &detail), detail);
}

ffi::Error IndexerBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                          ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                          ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                          ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> g, OptionalRanges row_ranges,
                          ffi::Result<ffi::Buffer<ffi::BF16>> d_index_q,
                          ffi::Result<ffi::Buffer<ffi::F32>> d_weights, ffi::Result<ffi::Buffer<ffi::F32>> d_index_k,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale, bool causal, int32_t k_stride,
                          bool deterministic) {
  return IndexerBwd(kIndexerBwdTarget, stream, index_q, index_k, weights, indices, target_dist, q_start, row_ranges,
                    lse, g, d_index_q, d_weights, d_index_k, workspace, scale, causal, k_stride, deterministic);
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
    return Checker{kIndexerBwdPoisonedTarget}.Invalid(
        "dq_init, dw_init and dk_init must be aliased to the outputs (input_output_aliases={9: 0, 10: 1, 11: 2})");
  return IndexerBwd(kIndexerBwdPoisonedTarget, stream, index_q, index_k, weights, indices, target_dist, q_start,
                    row_ranges, lse, g, d_index_q, d_weights, d_index_k, workspace, scale, causal, k_stride,
                    deterministic);
}

// The operand lists, shared by each target and its poisoned twin.
auto AttnDistOperands() {
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

auto IndexerOperands() {
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

auto IndexerBwdOperands() {
  return IndexerOperands()
      .Arg<ffi::Buffer<ffi::F32>>()    // lse
      .Arg<ffi::Buffer<ffi::F32>>();   // g
}

}  // namespace

// The main targets take SPEC §6's row ranges as an optional last operand, so
// that calls exported before it existed (one operand fewer) still run; the
// poisoned twins (tests only) take it in place, before their aliased inputs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttnDistFwd, AttnDistFwdImpl,
                              AttnDistResultsAndAttrs(AttnDistOperands().OptionalArg<ffi::Buffer<ffi::S32>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttnDistFwdInto, AttnDistFwdIntoImpl,
                              AttnDistResultsAndAttrs(AttnDistOperands()
                                                          .Arg<ffi::Buffer<ffi::S32>>()    // row_ranges
                                                          .Arg<ffi::Buffer<ffi::F32>>()),  // out_init
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerFwd, IndexerFwdImpl,
                              IndexerResultsAndAttrs(IndexerOperands().OptionalArg<ffi::Buffer<ffi::S32>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerFwdInto, IndexerFwdIntoImpl,
                              IndexerResultsAndAttrs(IndexerOperands()
                                                         .Arg<ffi::Buffer<ffi::S32>>()    // row_ranges
                                                         .Arg<ffi::Buffer<ffi::F32>>()    // kl_init
                                                         .Arg<ffi::Buffer<ffi::F32>>()),  // lse_init
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerBwd, IndexerBwdImpl,
                              IndexerBwdResultsAndAttrs(IndexerBwdOperands().OptionalArg<ffi::Buffer<ffi::S32>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerBwdInto, IndexerBwdIntoImpl,
                              IndexerBwdResultsAndAttrs(IndexerBwdOperands()
                                                            .Arg<ffi::Buffer<ffi::S32>>()    // row_ranges
                                                            .Arg<ffi::Buffer<ffi::BF16>>()   // dq_init
                                                            .Arg<ffi::Buffer<ffi::F32>>()    // dw_init
                                                            .Arg<ffi::Buffer<ffi::F32>>()),  // dk_init
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace attn_dist
