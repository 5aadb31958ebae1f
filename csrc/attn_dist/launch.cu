// Picks the compiled (D, head tile) variant of the attn_dist kernel.
#include "../params.h"
#include "config.h"

namespace attn_dist {

// Defined in kernel.cuh, instantiated in instantiations/*.cu.
template <class Cfg>
LaunchStatus run_variant(const AttnDistParams& params, cudaStream_t stream, const char** detail);

template <int D>
static LaunchStatus run_dim(const AttnDistParams& p, cudaStream_t stream, const char** detail) {
  // Up to 64 heads: one 64-head tile. Up to 96: one 96-head tile, which does
  // not compute the 128-head tile's masked columns. More: 128-head tiles, so
  // that a token's K rows are gathered once for two head groups.
  if (p.h_q <= 64) return run_variant<Config<D, 64>>(p, stream, detail);
  if (p.h_q <= 96) return run_variant<Config<D, 96>>(p, stream, detail);
  return run_variant<Config<D, 128>>(p, stream, detail);
}

LaunchStatus run_attn_dist(const AttnDistParams& p, cudaStream_t stream, const char** detail) {
  switch (p.d_qk) {
    case 576: return run_dim<576>(p, stream, detail);
    case 512: return run_dim<512>(p, stream, detail);
    default:
      *detail = "head dim must be 512 or 576";
      return LaunchStatus::kUnsupportedDim;
  }
}

}  // namespace attn_dist
