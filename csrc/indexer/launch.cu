// Picks the compiled (DI, head tile, head tiles) variant of the indexer_kl
// forward kernel: the table is indexer/variants.h (from variants.py); each
// variant is instantiated in its own generated file (a few to a unit).
#include <string>

#include "params.h"
#include "variants.h"

namespace attn_dist {
namespace indexer {

// config.h and kernel.cuh define these; the launcher needs only their names.
template <int DI, int HT, int kMaxHeadTiles>
struct Config;
template <class Cfg>
LaunchStatus run_variant(const IndexerFwdParams& params, cudaStream_t stream, const char** detail);

}  // namespace indexer

LaunchStatus run_indexer_fwd(const IndexerFwdParams& p, cudaStream_t stream, const char** detail) {
  // The narrowest WGMMA that holds the heads: less padding at HI = 16 or 32;
  // more than 64 heads run up to 4 tiles of 64 over the same key stages.
  if (!kIndexerFwdHeadDims.contains(p.d_idx)) {
    *detail = KeepMessage("the indexer head dim DI must be " + OrList(kIndexerFwdHeadDims));
    return LaunchStatus::kUnsupportedDim;
  }
  const int chosen = IndexerFwdVariantFor(p.d_idx, p.h_idx);
  if (chosen >= 0) {
    const IndexerFwdVariant& v = kIndexerFwdVariants[chosen];
#define INDEXER_FWD_VARIANT(DI, HT, TILES)                           \
  if (v.di == DI && v.head_tile == HT && v.head_tiles == TILES) \
    return indexer::run_variant<indexer::Config<DI, HT, TILES>>(p, stream, detail);
#include "indexer_fwd_variants.inc"
#undef INDEXER_FWD_VARIANT
  }
  *detail =
      KeepMessage("the indexer kernel takes at most " + std::to_string(IndexerFwdMaxHeads(p.d_idx)) + " heads");
  return LaunchStatus::kUnsupportedDim;
}

}  // namespace attn_dist
