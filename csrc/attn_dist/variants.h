// The compiled variants of the attn_dist kernel: jax_attn_dist/ops/attn_dist/
// variants.py's KERNEL_VARIANTS, which CMake writes to attn_dist_variants.inc
// (one ATTN_DIST_VARIANT(D, head_tile) line each) and instantiates one per
// generated file. The launcher dispatches over this table, the FFI
// handler checks D against it, and _cuda.kernel_variants() reports it.
#pragma once

#include "../common/variants.h"

namespace attn_dist {

struct AttnDistVariant {
  int d;          // head dim (MLA: 512 latent, + 64 rope)
  int head_tile;  // heads one CTA holds
};

inline constexpr AttnDistVariant kAttnDistVariants[] = {
#define ATTN_DIST_VARIANT(D, HT) {D, HT},
#include "attn_dist_variants.inc"
#undef ATTN_DIST_VARIANT
};

inline constexpr auto kAttnDistHeadDims = FieldSet(kAttnDistVariants, &AttnDistVariant::d);

// The head tile that serves H heads at head dim D: the smallest that holds H,
// else the largest (the kernel loops over its head tiles); 0 if no variant
// has head dim D.
constexpr int AttnDistHeadTile(int d, int h) {
  int fits = 0, largest = 0;
  for (const AttnDistVariant& v : kAttnDistVariants) {
    if (v.d != d) continue;
    if (v.head_tile >= h && (fits == 0 || v.head_tile < fits)) fits = v.head_tile;
    if (v.head_tile > largest) largest = v.head_tile;
  }
  return fits != 0 ? fits : largest;
}

}  // namespace attn_dist
