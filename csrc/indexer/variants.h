// The compiled variants of the indexer_kl kernels: jax_attn_dist/ops/indexer/
// variants.py's FWD_KERNEL_VARIANTS and BWD_KERNEL_VARIANTS, which CMake
// writes to indexer_fwd_variants.inc and indexer_bwd_variants.inc (one
// INDEXER_FWD_VARIANT(DI, head_tile, head_tiles) or
// INDEXER_BWD_VARIANT(DI, head_tile, deterministic) line each) and
// instantiates one per generated file. The launchers dispatch over
// these tables, the FFI handlers check DI and HI against them, and
// _cuda.kernel_variants() reports them.
#pragma once

#include "../common/variants.h"

namespace attn_dist {

struct IndexerFwdVariant {
  int di;          // indexer head dim
  int head_tile;   // WGMMA width in heads
  int head_tiles;  // tiles one CTA runs over the same key stages
  constexpr int max_heads() const { return head_tile * head_tiles; }
};

struct IndexerBwdVariant {
  int di;
  int head_tile;   // one tile: the CTA's heads
  bool deterministic;
};

inline constexpr IndexerFwdVariant kIndexerFwdVariants[] = {
#define INDEXER_FWD_VARIANT(DI, HT, TILES) {DI, HT, TILES},
#include "indexer_fwd_variants.inc"
#undef INDEXER_FWD_VARIANT
};

inline constexpr IndexerBwdVariant kIndexerBwdVariants[] = {
#define INDEXER_BWD_VARIANT(DI, HT, DETERMINISTIC) {DI, HT, DETERMINISTIC},
#include "indexer_bwd_variants.inc"
#undef INDEXER_BWD_VARIANT
};

inline constexpr auto kIndexerFwdHeadDims = FieldSet(kIndexerFwdVariants, &IndexerFwdVariant::di);
inline constexpr auto kIndexerBwdHeadDims = FieldSet(kIndexerBwdVariants, &IndexerBwdVariant::di);

// The most heads a variant of head dim DI serves (0: no variant has DI).
constexpr int IndexerFwdMaxHeads(int di) {
  int most = 0;
  for (const IndexerFwdVariant& v : kIndexerFwdVariants)
    if (v.di == di && v.max_heads() > most) most = v.max_heads();
  return most;
}
constexpr int IndexerBwdMaxHeads(int di, bool deterministic) {
  int most = 0;
  for (const IndexerBwdVariant& v : kIndexerBwdVariants)
    if (v.di == di && v.deterministic == deterministic && v.head_tile > most) most = v.head_tile;
  return most;
}

// The most heads any variant serves (what the FFI handlers accept).
constexpr int IndexerFwdMaxHeads() {
  int most = 0;
  for (const IndexerFwdVariant& v : kIndexerFwdVariants) most = v.max_heads() > most ? v.max_heads() : most;
  return most;
}
constexpr int IndexerBwdMaxHeads() {
  int most = 0;
  for (const IndexerBwdVariant& v : kIndexerBwdVariants) most = v.head_tile > most ? v.head_tile : most;
  return most;
}

// The variant that serves HI heads at head dim DI: the one that holds HI with
// the fewest heads (the first listed on a tie); -1 if none holds HI.
constexpr int IndexerFwdVariantFor(int di, int hi) {
  int best = -1;
  for (int i = 0; i < int(sizeof(kIndexerFwdVariants) / sizeof(kIndexerFwdVariants[0])); ++i) {
    const IndexerFwdVariant& v = kIndexerFwdVariants[i];
    if (v.di == di && v.max_heads() >= hi && (best < 0 || v.max_heads() < kIndexerFwdVariants[best].max_heads()))
      best = i;
  }
  return best;
}
constexpr int IndexerBwdVariantFor(int di, int hi, bool deterministic) {
  int best = -1;
  for (int i = 0; i < int(sizeof(kIndexerBwdVariants) / sizeof(kIndexerBwdVariants[0])); ++i) {
    const IndexerBwdVariant& v = kIndexerBwdVariants[i];
    if (v.di == di && v.deterministic == deterministic && v.head_tile >= hi &&
        (best < 0 || v.head_tile < kIndexerBwdVariants[best].head_tile))
      best = i;
  }
  return best;
}

}  // namespace attn_dist
