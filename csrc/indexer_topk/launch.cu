// Picks the compiled (DI, HI) variant of the indexer_topk kernel: the table is
// indexer_topk/variants.h (from variants.py); each variant is instantiated in
// its own generated file (CMake compiles a few to a unit).
#include <string>

#include <cutlass/bfloat16.h>
#include <cutlass/float8.h>

#include "params.h"
#include "variants.h"

namespace attn_dist {
using bf16 = cutlass::bfloat16_t;
namespace indexer_topk {

// config.h and kernel.cuh define these; the launcher needs only their names.
template <int DI, int HT, class Elem, bool kResident = false>
struct Config;
using fp8 = cutlass::float_e4m3_t;
template <class Cfg>
LaunchStatus run_variant(const IndexerTopkParams& params, cudaStream_t stream, const char** detail);

}  // namespace indexer_topk

LaunchStatus run_indexer_topk(const IndexerTopkParams& p, cudaStream_t stream, const char** detail) {
  if (!kIndexerTopkHeadDims.contains(p.d_idx)) {
    *detail = KeepMessage("the indexer head dim DI must be " + OrList(kIndexerTopkHeadDims));
    return LaunchStatus::kUnsupportedDim;
  }
  const int chosen = IndexerTopkVariantFor(p.d_idx, p.h_idx);
  if (chosen >= 0) {
    const IndexerTopkVariant& v = kIndexerTopkVariants[chosen];
#define INDEXER_TOPK_VARIANT(DI, HI)                                                                    \
  if (v.di == DI && v.hi == HI)                                                                         \
    return p.float8_inputs                                                                              \
               ? indexer_topk::run_variant<indexer_topk::Config<DI, HI, indexer_topk::fp8>>(p, stream, detail) \
               : indexer_topk::run_variant<indexer_topk::Config<DI, HI, bf16>>(p, stream, detail);
#include "indexer_topk_variants.inc"
#undef INDEXER_TOPK_VARIANT
  }
  *detail = KeepMessage("the indexer_topk kernel takes at most " + std::to_string(IndexerTopkMaxHeads(p.d_idx)) +
                        " heads at DI = " + std::to_string(p.d_idx));
  return LaunchStatus::kUnsupportedDim;
}

}  // namespace attn_dist
