// The sparse MLA backward on a stream: zero what is accumulated into, the row
// terms (and, deterministic, max |kv| and the bound first), the main kernel
// of the compiled D variant (the table: sparse_mla/variants.h, each variant
// instantiated in its own generated file), then (deterministic) the
// conversion of the fixed-point sums, or the float32 sums' columns put back
// in order.
#include <cuda_runtime_api.h>

#include "../fixed_point/limbs.h"
#include "bwd_rows.h"
#include "params.h"
#include "variants.h"

namespace attn_dist {
namespace sparse_mla {

// bwd_config.h and bwd_kernel.cuh define these; the launcher needs only their names.
template <int D, int HT, bool kDeterministic>
struct BwdConfig;
template <class Cfg>
LaunchStatus run_bwd_variant(const SparseMlaBwdParams& params, cudaStream_t stream, const char** detail);

namespace {

LaunchStatus run_main(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail) {
  const bool deterministic = p.dkv_fixed != nullptr;
#define SPARSE_MLA_VARIANT(D, HT)                                                                  \
  if (p.d_qk == D)                                                                                 \
    return deterministic ? run_bwd_variant<BwdConfig<D, HT, true>>(p, stream, detail)              \
                         : run_bwd_variant<BwdConfig<D, HT, false>>(p, stream, detail);
#include "sparse_mla_variants.inc"
#undef SPARSE_MLA_VARIANT
  *detail = KeepMessage("head dim must be " + OrList(kSparseMlaHeadDims));
  return LaunchStatus::kUnsupportedDim;
}

LaunchStatus memset_status(cudaError_t err, const char** detail) {
  if (err == cudaSuccess) return LaunchStatus::kOk;
  *detail = cudaGetErrorString(err);
  return LaunchStatus::kLaunchError;
}

}  // namespace
}  // namespace sparse_mla

namespace sparse_mla {
namespace {

LaunchStatus check_problem(const SparseMlaBwdParams& p, const char** detail) {
  if (p.batch < 1 || p.s_q < 1 || p.h_q < 1 || p.topk < 0 || p.s_kv < 0) {
    *detail = "empty or invalid problem (B, S and H must be >= 1): nothing to launch";
    return LaunchStatus::kInvalidProblem;
  }
  if (p.d_v != 512) {
    *detail = "the kernel computes d_v = 512 value dims";
    return LaunchStatus::kInvalidProblem;
  }
  if (p.dkv_fixed != nullptr &&
      (p.bound_bits == nullptr || p.kv_max_bits == nullptr || p.flag_bits == nullptr || p.scale_rows < p.s_q)) {
    *detail = "the deterministic backward needs its bound and flag words, and at least its own rows to scale for";
    return LaunchStatus::kInvalidProblem;
  }
  return LaunchStatus::kOk;
}

LaunchStatus zero(void* ptr, size_t bytes, cudaStream_t stream, const char** detail) {
  return bytes == 0 ? LaunchStatus::kOk : memset_status(cudaMemsetAsync(ptr, 0, bytes, stream), detail);
}

size_t dkv_elements(const SparseMlaBwdParams& p) { return size_t(p.batch) * size_t(p.s_kv) * size_t(p.d_qk); }

// max |kv| and the rows' bounds into the zeroed scale words, and the row terms.
LaunchStatus run_scale_words(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail) {
  LaunchStatus s;
  if ((s = zero(p.kv_max_bits, size_t(p.batch) * sizeof(unsigned), stream, detail)) != LaunchStatus::kOk ||
      (s = zero(p.bound_bits, size_t(p.batch) * sizeof(unsigned), stream, detail)) != LaunchStatus::kOk)
    return s;
  if (dkv_elements(p) > 0 && (s = launch_kv_max(p, stream, detail)) != LaunchStatus::kOk) return s;
  return launch_row_terms(p, true, stream, detail);
}

}  // namespace
}  // namespace sparse_mla

LaunchStatus run_sparse_mla_bwd(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail) {
  using namespace sparse_mla;
  LaunchStatus s;
  if ((s = check_problem(p, detail)) != LaunchStatus::kOk) return s;
  const bool deterministic = p.dkv_fixed != nullptr;
  if (deterministic && p.flag_bits != p.bound_bits) {
    *detail = "one call flags its terms in its bound words";
    return LaunchStatus::kInvalidProblem;
  }
  const size_t dkv_elems = dkv_elements(p);
  if (deterministic) {
    if ((s = zero(p.dkv_fixed, dkv_elems * sizeof(long long), stream, detail)) != LaunchStatus::kOk ||
        (s = run_scale_words(p, stream, detail)) != LaunchStatus::kOk)
      return s;
  } else if ((s = zero(p.dkv, dkv_elems * sizeof(float), stream, detail)) != LaunchStatus::kOk ||
             (s = launch_row_terms(p, false, stream, detail)) != LaunchStatus::kOk) {
    return s;
  }
  if ((s = run_main(p, stream, detail)) != LaunchStatus::kOk) return s;
  if (dkv_elems == 0) return LaunchStatus::kOk;
  return deterministic ? launch_dkv_fixed_to_float(p, stream, detail) : launch_dkv_columns_in_order(p, stream, detail);
}

LaunchStatus run_sparse_mla_bwd_bound(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail) {
  using namespace sparse_mla;
  LaunchStatus s;
  if ((s = check_problem(p, detail)) != LaunchStatus::kOk) return s;
  return run_scale_words(p, stream, detail);
}

LaunchStatus run_sparse_mla_bwd_fixed(const SparseMlaBwdParams& p, int32_t* limbs, int32_t* flags,
                                      cudaStream_t stream, const char** detail) {
  using namespace sparse_mla;
  LaunchStatus s;
  if ((s = check_problem(p, detail)) != LaunchStatus::kOk) return s;
  if (p.dkv_fixed == nullptr || p.flag_bits == p.bound_bits) {
    *detail = "the sharded deterministic backward needs its fixed-point sums and flag words apart from the bounds";
    return LaunchStatus::kInvalidProblem;
  }
  const size_t dkv_elems = dkv_elements(p);
  if ((s = zero(p.dkv_fixed, dkv_elems * sizeof(long long), stream, detail)) != LaunchStatus::kOk ||
      (s = zero(p.flag_bits, size_t(p.batch) * sizeof(unsigned), stream, detail)) != LaunchStatus::kOk ||
      (s = run_main(p, stream, detail)) != LaunchStatus::kOk)
    return s;
  return launch_fixed_to_limbs(p.dkv_fixed, p.flag_bits, p.batch, int64_t(p.s_kv) * p.d_qk, limbs, flags, stream,
                               detail);
}

}  // namespace attn_dist
