// The compiled variants of the indexer_topk kernel: jax_attn_dist/ops/
// indexer_topk/variants.py's KERNEL_VARIANTS, which CMake writes to
// indexer_topk_variants.inc (one INDEXER_TOPK_VARIANT(DI, HI) line each) and
// instantiates one per generated file. The launcher dispatches
// over this table, the FFI handler checks DI and HI against it, and
// _cuda.kernel_variants() reports it.
#pragma once

#include "../common/variants.h"

namespace attn_dist {

struct IndexerTopkVariant {
  int di;  // indexer head dim
  int hi;  // indexer heads the kernel holds per row (it serves 1 .. hi)
};

inline constexpr IndexerTopkVariant kIndexerTopkVariants[] = {
#define INDEXER_TOPK_VARIANT(DI, HI) {DI, HI},
#include "indexer_topk_variants.inc"
#undef INDEXER_TOPK_VARIANT
};

inline constexpr auto kIndexerTopkHeadDims = FieldSet(kIndexerTopkVariants, &IndexerTopkVariant::di);

// The most heads a variant of head dim DI serves (0: none has DI).
constexpr int IndexerTopkMaxHeads(int di) {
  int most = 0;
  for (const IndexerTopkVariant& v : kIndexerTopkVariants)
    if (v.di == di && v.hi > most) most = v.hi;
  return most;
}

// The variant that serves HI heads at head dim DI: the one with the fewest
// heads that holds HI (the first listed on a tie); -1 if none does.
constexpr int IndexerTopkVariantFor(int di, int hi) {
  int best = -1;
  for (int i = 0; i < int(sizeof(kIndexerTopkVariants) / sizeof(kIndexerTopkVariants[0])); ++i) {
    const IndexerTopkVariant& v = kIndexerTopkVariants[i];
    if (v.di == di && v.hi >= hi && (best < 0 || v.hi < kIndexerTopkVariants[best].hi)) best = i;
  }
  return best;
}

}  // namespace attn_dist
