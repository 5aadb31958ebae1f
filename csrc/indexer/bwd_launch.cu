// Picks the compiled (DI, head tile, deterministic) variant of the indexer_kl
// backward kernel: the table is indexer/variants.h (from variants.py); each
// variant is instantiated in its own generated file (a few to a unit).
#include <string>

#include "../fixed_point/limbs.h"
#include "fixed_point.cuh"
#include "params.h"
#include "variants.h"

namespace attn_dist {
namespace indexer {

// bwd_config.h and bwd_kernel.cuh define these; the launcher needs only their names.
template <int DI, int HT, bool kDeterministic>
struct BwdConfig;
template <class Cfg>
LaunchStatus run_bwd_variant(const IndexerBwdParams& params, cudaStream_t stream, const char** detail);

}  // namespace indexer

LaunchStatus run_indexer_bwd(const IndexerBwdParams& p, cudaStream_t stream, const char** detail) {
  if (!kIndexerBwdHeadDims.contains(p.d_idx)) {
    *detail = KeepMessage("the indexer head dim DI must be " + OrList(kIndexerBwdHeadDims));
    return LaunchStatus::kUnsupportedDim;
  }
  const bool deterministic = p.dk_fixed != nullptr;
  if (deterministic && (p.bound_bits == nullptr || p.flag_bits == nullptr || p.scale_rows < int64_t(p.batch) * p.s_q)) {
    *detail = "the deterministic backward needs its bound and flag words, and at least its own rows to scale for";
    return LaunchStatus::kInvalidProblem;
  }
  if (p.sums_only != (deterministic && p.flag_bits != p.bound_bits)) {
    *detail = "a deterministic call flags its terms in its bound word unless it leaves its sums fixed-point";
    return LaunchStatus::kInvalidProblem;
  }
  // The narrowest head tile that holds the heads, as in the forward.
  const int chosen = IndexerBwdVariantFor(p.d_idx, p.h_idx, deterministic);
  if (chosen >= 0) {
    const IndexerBwdVariant& v = kIndexerBwdVariants[chosen];
#define INDEXER_BWD_VARIANT(DI, HT, DETERMINISTIC)                                \
  if (v.di == DI && v.head_tile == HT && v.deterministic == DETERMINISTIC) \
    return indexer::run_bwd_variant<indexer::BwdConfig<DI, HT, DETERMINISTIC>>(p, stream, detail);
#include "indexer_bwd_variants.inc"
#undef INDEXER_BWD_VARIANT
  }
  if (IndexerBwdMaxHeads(p.d_idx, deterministic) == 0)
    *detail = KeepMessage(std::string("the indexer backward kernel has no ") +
                          (deterministic ? "deterministic" : "float32-sum") + " variant for DI = " +
                          std::to_string(p.d_idx));
  else
    *detail = KeepMessage("the indexer backward kernel takes at most " +
                          std::to_string(IndexerBwdMaxHeads(p.d_idx, deterministic)) + " heads");
  return LaunchStatus::kUnsupportedDim;
}

LaunchStatus run_indexer_bwd_bound(const IndexerBwdParams& p, cudaStream_t stream, const char** detail) {
  if (p.bound_bits == nullptr) {
    *detail = "the bound needs its word";
    return LaunchStatus::kInvalidProblem;
  }
  return indexer::launch_row_bounds(p, stream, detail);
}

LaunchStatus run_indexer_bwd_fixed(const IndexerBwdParams& p, int32_t* limbs, int32_t* flags, cudaStream_t stream,
                                   const char** detail) {
  if (!p.sums_only || p.dk_fixed == nullptr) {
    *detail = "the sharded deterministic backward leaves its sums fixed-point";
    return LaunchStatus::kInvalidProblem;
  }
  if (LaunchStatus s = run_indexer_bwd(p, stream, detail); s != LaunchStatus::kOk) return s;
  return launch_fixed_to_limbs(p.dk_fixed, p.flag_bits, 1, int64_t(p.batch) * p.s_kv * p.d_idx, limbs, flags, stream,
                               detail);
}

}  // namespace attn_dist
