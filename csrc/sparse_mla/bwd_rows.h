// The sparse MLA backward's small kernels around the main one (bwd_rows.cu):
// the per-head row terms every mode needs, and the deterministic mode's
// bound and conversion (common/fixed_point.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include "params.h"

namespace attn_dist {
namespace sparse_mla {

// row_delta = rowsum(dout * out) - dlse (in base e) per (row, head); with
// with_bound, also each row's bound on its dkv terms, max-reduced into its
// batch element's bound_bits (needs kv_max_bits from launch_kv_max first).
LaunchStatus launch_row_terms(const SparseMlaBwdParams& p, bool with_bound, cudaStream_t stream, const char** detail);

// max |kv| of each batch element, as float bits into kv_max_bits (zeroed first).
LaunchStatus launch_kv_max(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail);

// The float32 dkv, which the main kernel adds into in its accumulator's
// column order (bwd_steps.cuh), back to column order in place.
LaunchStatus launch_dkv_columns_in_order(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail);

// dkv = dkv_fixed * 2^-F per batch element (NaN over an element whose bound or
// a term was not finite).
LaunchStatus launch_dkv_fixed_to_float(const SparseMlaBwdParams& p, cudaStream_t stream, const char** detail);

}  // namespace sparse_mla
}  // namespace attn_dist
