// The indexer_kl op's XLA FFI handlers (forward and backward): re-validate
// what Python checked at trace time, then launch. Errors are returned as
// ffi::Error, never aborts; no host synchronisation and no allocation, so XLA
// may capture the calls in CUDA graphs.
#include "ffi.h"

#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "../common/fixed_point_limbs.cuh"
#include "params.h"
#include "variants.h"

namespace attn_dist {
namespace {

// The operands both indexer targets take, checked once: shapes, DI (one of
// head_dims), HI (at most max_heads), scale, k_stride and int32 sizes. On
// success `dims` holds B, S, HI, DI, N, T.
struct IndexerDims {
  int64_t B, S, HI, DI, N, T;
};

template <size_t kDims>
ffi::Error CheckIndexerOperands(const Checker& check, const ffi::Buffer<ffi::BF16>& index_q,
                                const ffi::Buffer<ffi::BF16>& index_k, const ffi::Buffer<ffi::F32>& weights,
                                const ffi::Buffer<ffi::S32>& indices, const ffi::Buffer<ffi::F32>& target_dist,
                                const ffi::Buffer<ffi::S32>& q_start, const OptionalRanges& row_ranges,
                                float scale, int32_t k_stride, const IntSet<kDims>& head_dims, int64_t max_heads,
                                IndexerDims* dims, const int32_t** ranges) {
  const auto qd = index_q.dimensions();
  if (qd.size() != 4) return check.Invalid("index_q must be rank 4 [B, S, HI, DI], got " + Shape(qd));
  const int64_t B = qd[0], S = qd[1], HI = qd[2], DI = qd[3];
  const auto kd = index_k.dimensions();
  if (kd.size() != 3) return check.Invalid("index_k must be rank 3 [B, N, DI], got " + Shape(kd));
  const int64_t N = kd[1];
  const auto id = indices.dimensions();
  if (id.size() != 4) return check.Invalid("indices must be rank 4 [B, S, 1, T], got " + Shape(id));
  const int64_t T = id[3];

  if (!OneOf(DI, head_dims))
    return check.Invalid("the indexer head dim DI must be " + OrList(head_dims) + ", got " + std::to_string(DI));
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
  if (auto e = CheckProblemSize(check, S, N, T, B * S, "B * S"); e.failure()) return e;
  if (!Aligned16(index_q.untyped_data()) || !Aligned16(index_k.untyped_data()))
    return check.Invalid("index_q and index_k must be 16-byte aligned");
  *dims = IndexerDims{B, S, HI, DI, N, T};
  return ffi::Error::Success();
}

// The operands every backward target checks alike: the forward's, with the
// backward's head dims and heads, and the forward's lse and the loss
// cotangent g, both [B, S].
ffi::Error CheckIndexerBwdOperands(const Checker& check, const ffi::Buffer<ffi::BF16>& index_q,
                                   const ffi::Buffer<ffi::BF16>& index_k, const ffi::Buffer<ffi::F32>& weights,
                                   const ffi::Buffer<ffi::S32>& indices, const ffi::Buffer<ffi::F32>& target_dist,
                                   const ffi::Buffer<ffi::S32>& q_start, const OptionalRanges& row_ranges,
                                   const ffi::Buffer<ffi::F32>& lse, const ffi::Buffer<ffi::F32>& g, float scale,
                                   int32_t k_stride, IndexerDims* dims, const int32_t** ranges) {
  if (auto e = CheckIndexerOperands(check, index_q, index_k, weights, indices, target_dist, q_start, row_ranges, scale,
                                    k_stride, kIndexerBwdHeadDims, IndexerBwdMaxHeads(), dims, ranges);
      e.failure())
    return e;
  if (auto e = check.Shape("lse", lse.dimensions(), {dims->B, dims->S}, "[B, S]"); e.failure()) return e;
  return check.Shape("g", g.dimensions(), {dims->B, dims->S}, "[B, S]");
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

}  // namespace

ffi::Error IndexerFwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q,
                          ffi::Buffer<ffi::BF16> index_k, ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> target_dist,
                          ffi::Buffer<ffi::S32> q_start, OptionalRanges row_ranges,
                          ffi::Result<ffi::Buffer<ffi::F32>> kl, ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                          bool causal, int32_t k_stride) {
  const Checker check{target};
  IndexerDims d{};
  const int32_t* ranges = nullptr;
  if (auto e = CheckIndexerOperands(check, index_q, index_k, weights, indices, target_dist, q_start, row_ranges, scale,
                                    k_stride, kIndexerFwdHeadDims, IndexerFwdMaxHeads(), &d, &ranges);
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

ffi::Error IndexerBwdCall(const char* target, cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q,
                          ffi::Buffer<ffi::BF16> index_k, ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> target_dist,
                          ffi::Buffer<ffi::S32> q_start, OptionalRanges row_ranges, ffi::Buffer<ffi::F32> lse,
                          ffi::Buffer<ffi::F32> g, ffi::Result<ffi::Buffer<ffi::BF16>> d_index_q,
                          ffi::Result<ffi::Buffer<ffi::F32>> d_weights, ffi::Result<ffi::Buffer<ffi::F32>> d_index_k,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale, bool causal, int32_t k_stride,
                          bool deterministic) {
  const Checker check{target};
  IndexerDims d{};
  const int32_t* ranges = nullptr;
  if (auto e = CheckIndexerBwdOperands(check, index_q, index_k, weights, indices, target_dist, q_start, row_ranges,
                                       lse, g, scale, k_stride, &d, &ranges);
      e.failure())
    return e;
  const int64_t B = d.B, S = d.S, HI = d.HI, DI = d.DI, N = d.N;
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
    p.flag_bits = p.bound_bits;  // one call: a flagged term raises the bound itself
    p.scale_rows = B * S;
  }

  const char* detail = "";
  return check.Launched(run_indexer_bwd(p, stream, &detail), detail);
}

namespace {

// The sharded deterministic backward's first call: the rows' largest bound,
// as float bits, into bound [1].
ffi::Error IndexerBwdBoundImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                               ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                               ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                               ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> g, OptionalRanges row_ranges,
                               ffi::Result<ffi::Buffer<ffi::S32>> bound, float scale, bool causal,
                               int32_t k_stride) {
  const Checker check{kIndexerBwdBoundTarget};
  IndexerDims d{};
  const int32_t* ranges = nullptr;
  if (auto e = CheckIndexerBwdOperands(check, index_q, index_k, weights, indices, target_dist, q_start, row_ranges,
                                       lse, g, scale, k_stride, &d, &ranges);
      e.failure())
    return e;
  if (auto e = check.Shape("bound", bound->dimensions(), {1}, "[1]"); e.failure()) return e;
  if (cudaMemsetAsync(bound->untyped_data(), 0, bound->size_bytes(), stream) != cudaSuccess)
    return ffi::Error::Internal(std::string(check.target) + ": clearing the bound failed");
  if (d.B * d.S == 0) return ffi::Error::Success();  // no rows: bound 0
  IndexerBwdParams p{};
  FillIndexerProblem(p, d, index_q, index_k, weights, indices, target_dist, q_start, ranges, scale, causal,
                     k_stride);
  p.lse = lse.typed_data();
  p.g = g.typed_data();
  p.bound_bits = reinterpret_cast<unsigned int*>(bound->typed_data());
  const char* detail = "";
  return check.Launched(run_indexer_bwd_bound(p, stream, &detail), detail);
}

// The sharded deterministic backward's second call: given every shard's
// bound, d_index_q, d_weights and this shard's fixed-point sums of
// d_index_k as limbs [3, 1, B * N * DI] and a flag [1]; F chosen for
// scale_rows rows. The workspace: the int64 sums [B, N, DI], then the flag
// word (8 bytes).
ffi::Error IndexerBwdFixedImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                               ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                               ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                               ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::S32> bound,
                               OptionalRanges row_ranges, ffi::Result<ffi::Buffer<ffi::BF16>> d_index_q,
                               ffi::Result<ffi::Buffer<ffi::F32>> d_weights, ffi::Result<ffi::Buffer<ffi::S32>> limbs,
                               ffi::Result<ffi::Buffer<ffi::S32>> flags, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                               float scale, bool causal, int32_t k_stride, int64_t scale_rows) {
  const Checker check{kIndexerBwdFixedTarget};
  IndexerDims d{};
  const int32_t* ranges = nullptr;
  if (auto e = CheckIndexerBwdOperands(check, index_q, index_k, weights, indices, target_dist, q_start, row_ranges,
                                       lse, g, scale, k_stride, &d, &ranges);
      e.failure())
    return e;
  const int64_t B = d.B, S = d.S, HI = d.HI, DI = d.DI, N = d.N;
  if (auto e = check.Shape("bound", bound.dimensions(), {1}, "[1]"); e.failure()) return e;
  if (auto e = check.Shape("d_index_q", d_index_q->dimensions(), {B, S, HI, DI}, "[B, S, HI, DI]"); e.failure())
    return e;
  if (auto e = check.Shape("d_weights", d_weights->dimensions(), {B, S, HI}, "[B, S, HI]"); e.failure()) return e;
  const int64_t dk_elems = B * N * DI;
  if (auto e = check.Shape("limbs", limbs->dimensions(), {3, 1, dk_elems}, "[3, 1, B * N * DI]"); e.failure())
    return e;
  if (auto e = check.Shape("flags", flags->dimensions(), {1}, "[1]"); e.failure()) return e;
  if (scale_rows < B * S || scale_rows > kMaxScaleRows)
    return check.Invalid("scale_rows must be at least this shard's rows B * S = " + std::to_string(B * S) +
                         " and at most 2^40, got " + std::to_string(scale_rows));
  const int64_t want_ws = (dk_elems + 1) * int64_t(sizeof(int64_t));
  if (int64_t(workspace->element_count()) != want_ws)
    return check.Invalid("workspace must be uint8 [" + std::to_string(want_ws) + "] (8 * (B * N * DI + 1)), got " +
                         attn_dist::Shape(workspace->dimensions()));
  if (!Aligned16(workspace->untyped_data())) return check.Invalid("workspace must be 16-byte aligned");
  const bool rows = B * S > 0;
  // The sums and the flag start from zero (with no rows, the limbs are the zero sums).
  void* const zeroed = rows ? workspace->untyped_data() : limbs->untyped_data();
  const size_t zeroed_bytes = rows ? size_t(want_ws) : limbs->size_bytes();
  if ((zeroed_bytes > 0 && cudaMemsetAsync(zeroed, 0, zeroed_bytes, stream) != cudaSuccess) ||
      cudaMemsetAsync(flags->untyped_data(), 0, flags->size_bytes(), stream) != cudaSuccess)
    return ffi::Error::Internal(std::string(check.target) + ": clearing the d_index_k sums failed");
  if (!rows) return ffi::Error::Success();

  IndexerBwdParams p{};
  FillIndexerProblem(p, d, index_q, index_k, weights, indices, target_dist, q_start, ranges, scale, causal,
                     k_stride);
  p.lse = lse.typed_data();
  p.g = g.typed_data();
  p.d_index_q = d_index_q->untyped_data();
  p.d_weights = d_weights->typed_data();
  p.dk_fixed = static_cast<long long*>(workspace->untyped_data());
  // read only here: every shard's bound
  p.bound_bits = reinterpret_cast<unsigned int*>(const_cast<int32_t*>(bound.typed_data()));
  p.flag_bits = reinterpret_cast<unsigned int*>(p.dk_fixed + dk_elems);
  p.scale_rows = scale_rows;
  p.sums_only = true;
  const char* detail = "";
  return check.Launched(run_indexer_bwd_fixed(p, limbs->typed_data(), flags->typed_data(), stream, &detail), detail);
}

ffi::Error IndexerFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                          ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                          ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                          OptionalRanges row_ranges,
                          ffi::Result<ffi::Buffer<ffi::F32>> kl, ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                          bool causal, int32_t k_stride) {
  return IndexerFwdCall(kIndexerFwdTarget, stream, index_q, index_k, weights, indices, target_dist, q_start,
                        row_ranges, kl, lse, scale, causal, k_stride);
}

ffi::Error IndexerBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> index_q, ffi::Buffer<ffi::BF16> index_k,
                          ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> indices,
                          ffi::Buffer<ffi::F32> target_dist, ffi::Buffer<ffi::S32> q_start,
                          ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> g, OptionalRanges row_ranges,
                          ffi::Result<ffi::Buffer<ffi::BF16>> d_index_q,
                          ffi::Result<ffi::Buffer<ffi::F32>> d_weights, ffi::Result<ffi::Buffer<ffi::F32>> d_index_k,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale, bool causal, int32_t k_stride,
                          bool deterministic) {
  return IndexerBwdCall(kIndexerBwdTarget, stream, index_q, index_k, weights, indices, target_dist, q_start,
                        row_ranges, lse, g, d_index_q, d_weights, d_index_k, workspace, scale, causal, k_stride,
                        deterministic);
}

}  // namespace

// SPEC §6's row ranges are an optional last operand, so that calls exported
// before it existed (one operand fewer) still run.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerFwd, IndexerFwdImpl,
                              IndexerResultsAndAttrs(IndexerOperands().OptionalArg<ffi::Buffer<ffi::S32>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerBwd, IndexerBwdImpl,
                              IndexerBwdResultsAndAttrs(IndexerBwdOperands().OptionalArg<ffi::Buffer<ffi::S32>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerBwdBound, IndexerBwdBoundImpl,
                              IndexerBwdOperands()
                                  .OptionalArg<ffi::Buffer<ffi::S32>>()  // row_ranges
                                  .Ret<ffi::Buffer<ffi::S32>>()          // bound
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("k_stride"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexerBwdFixed, IndexerBwdFixedImpl,
                              IndexerBwdOperands()
                                  .Arg<ffi::Buffer<ffi::S32>>()          // bound
                                  .OptionalArg<ffi::Buffer<ffi::S32>>()  // row_ranges
                                  .Ret<ffi::Buffer<ffi::BF16>>()         // d_index_q
                                  .Ret<ffi::Buffer<ffi::F32>>()          // d_weights
                                  .Ret<ffi::Buffer<ffi::S32>>()          // limbs
                                  .Ret<ffi::Buffer<ffi::S32>>()          // flags
                                  .Ret<ffi::Buffer<ffi::U8>>()           // workspace
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("k_stride")
                                  .Attr<int64_t>("scale_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace attn_dist
