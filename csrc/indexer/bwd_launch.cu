// Picks the compiled (DI, head tile) variant of the indexer_kl backward kernel.
#include "../params.h"
#include "bwd_config.h"

namespace attn_dist {
namespace indexer {

// Defined in bwd_kernel.cuh, instantiated in instantiations/indexer_bwd_*.cu.
template <class Cfg>
LaunchStatus run_bwd_variant(const IndexerBwdParams& params, cudaStream_t stream, const char** detail);

template <int DI, bool kDeterministic>
static LaunchStatus run_bwd_heads(const IndexerBwdParams& p, cudaStream_t stream, const char** detail) {
  // The narrowest head tile that holds the heads, as in the forward.
  if (p.h_idx <= 16) return run_bwd_variant<BwdConfig<DI, 16, kDeterministic>>(p, stream, detail);
  if (p.h_idx <= 32) return run_bwd_variant<BwdConfig<DI, 32, kDeterministic>>(p, stream, detail);
  if (p.h_idx <= 64) return run_bwd_variant<BwdConfig<DI, 64, kDeterministic>>(p, stream, detail);
  *detail = "the indexer backward kernel takes at most 64 heads";
  return LaunchStatus::kUnsupportedDim;
}

template <int DI>
static LaunchStatus run_bwd_dim(const IndexerBwdParams& p, cudaStream_t stream, const char** detail) {
  if (p.dk_fixed == nullptr) return run_bwd_heads<DI, false>(p, stream, detail);
  if (p.bound_bits == nullptr) {
    *detail = "the deterministic backward needs its bound word";
    return LaunchStatus::kInvalidProblem;
  }
  return run_bwd_heads<DI, true>(p, stream, detail);
}

}  // namespace indexer

LaunchStatus run_indexer_bwd(const IndexerBwdParams& p, cudaStream_t stream, const char** detail) {
  switch (p.d_idx) {
    case 128: return indexer::run_bwd_dim<128>(p, stream, detail);
    case 64: return indexer::run_bwd_dim<64>(p, stream, detail);
    default:
      *detail = "the indexer head dim DI must be 64 or 128";
      return LaunchStatus::kUnsupportedDim;
  }
}

}  // namespace attn_dist
