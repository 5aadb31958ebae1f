// Picks the compiled D variant of the sparse MLA forward kernel: the table is
// sparse_mla/variants.h (from variants.py); each variant is instantiated in its
// own generated file (CMake compiles a few to a unit).
#include "params.h"
#include "variants.h"

namespace attn_dist {
namespace sparse_mla {

// config.h and kernel.cuh define these; the launcher needs only their names.
template <int D, int HT>
struct FwdConfig;
template <class Cfg>
LaunchStatus run_fwd_variant(const SparseMlaFwdParams& params, cudaStream_t stream, const char** detail);

}  // namespace sparse_mla

LaunchStatus run_sparse_mla_fwd(const SparseMlaFwdParams& p, cudaStream_t stream, const char** detail) {
#define SPARSE_MLA_VARIANT(D, HT) \
  if (p.d_qk == D) return sparse_mla::run_fwd_variant<sparse_mla::FwdConfig<D, HT>>(p, stream, detail);
#include "sparse_mla_variants.inc"
#undef SPARSE_MLA_VARIANT
  *detail = KeepMessage("head dim must be " + OrList(kSparseMlaHeadDims));
  return LaunchStatus::kUnsupportedDim;
}

}  // namespace attn_dist
