// Picks the compiled (DI, head tile, head tiles) variant of the indexer_kl forward kernel.
#include "../params.h"
#include "config.h"

namespace attn_dist {
namespace indexer {

// Defined in kernel.cuh, instantiated in instantiations/*.cu.
template <class Cfg>
LaunchStatus run_variant(const IndexerFwdParams& params, cudaStream_t stream, const char** detail);

template <int DI>
static LaunchStatus run_dim(const IndexerFwdParams& p, cudaStream_t stream, const char** detail) {
  // The narrowest WGMMA that holds the heads: less padding at HI = 16 or 32;
  // more than 64 heads run up to 4 tiles of 64 over the same key stages.
  if (p.h_idx <= 16) return run_variant<Config<DI, 16, 1>>(p, stream, detail);
  if (p.h_idx <= 32) return run_variant<Config<DI, 32, 1>>(p, stream, detail);
  if (p.h_idx <= 64) return run_variant<Config<DI, 64, 1>>(p, stream, detail);
  if (p.h_idx <= 256) return run_variant<Config<DI, 64, 4>>(p, stream, detail);
  *detail = "the indexer kernel takes at most 256 heads";
  return LaunchStatus::kUnsupportedDim;
}

}  // namespace indexer

LaunchStatus run_indexer_fwd(const IndexerFwdParams& p, cudaStream_t stream, const char** detail) {
  switch (p.d_idx) {
    case 128: return indexer::run_dim<128>(p, stream, detail);
    case 64: return indexer::run_dim<64>(p, stream, detail);
    default:
      *detail = "the indexer head dim DI must be 64 or 128";
      return LaunchStatus::kUnsupportedDim;
  }
}

}  // namespace attn_dist
