// The compiled variants of the sparse MLA forward kernel: jax_attn_dist/ops/
// sparse_mla/variants.py's KERNEL_VARIANTS, which CMake writes to
// sparse_mla_variants.inc (one SPARSE_MLA_VARIANT(D, head_tile) line each) and
// instantiates one per generated file. The launcher dispatches
// over this table, the FFI handler checks D against it, and
// _cuda.kernel_variants() reports it.
#pragma once

#include "../common/variants.h"

namespace attn_dist {

struct SparseMlaVariant {
  int d;          // head dim of q and kv (MLA: 512 latent, + 64 rope)
  int head_tile;  // heads one CTA holds
};

inline constexpr SparseMlaVariant kSparseMlaVariants[] = {
#define SPARSE_MLA_VARIANT(D, HT) {D, HT},
#include "sparse_mla_variants.inc"
#undef SPARSE_MLA_VARIANT
};

inline constexpr auto kSparseMlaHeadDims = FieldSet(kSparseMlaVariants, &SparseMlaVariant::d);

}  // namespace attn_dist
