// Picks the compiled (D, head tile) variant of the attn_dist kernel: the
// table is attn_dist/variants.h (from variants.py); each variant is
// instantiated in its own generated file (CMake compiles a few to a unit).
#include "params.h"
#include "variants.h"

namespace attn_dist {
namespace dist {

// config.h and kernel.cuh define these; the launcher needs only their names.
template <int D, int HT>
struct Config;
template <class Cfg>
LaunchStatus run_variant(const AttnDistParams& params, cudaStream_t stream, const char** detail);

}  // namespace dist

LaunchStatus run_attn_dist(const AttnDistParams& p, cudaStream_t stream, const char** detail) {
  // Up to 64 heads: one 64-head tile. Up to 96: one 96-head tile, which does
  // not compute the 128-head tile's masked columns. More: 128-head tiles, so
  // that a token's K rows are gathered once for two head groups.
  const int head_tile = AttnDistHeadTile(p.d_qk, p.h_q);
#define ATTN_DIST_VARIANT(D, HT) \
  if (p.d_qk == D && head_tile == HT) return dist::run_variant<dist::Config<D, HT>>(p, stream, detail);
#include "attn_dist_variants.inc"
#undef ATTN_DIST_VARIANT
  *detail = KeepMessage("head dim must be " + OrList(kAttnDistHeadDims));
  return LaunchStatus::kUnsupportedDim;
}

}  // namespace attn_dist
