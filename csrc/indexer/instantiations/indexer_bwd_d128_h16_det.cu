// One variant of the indexer_kl backward kernel (bwd_kernel.cuh): deterministic
// (fixed-point) d_index_k.
#include "../bwd_kernel.cuh"

INDEXER_BWD_INSTANTIATE(128, 16, true)
