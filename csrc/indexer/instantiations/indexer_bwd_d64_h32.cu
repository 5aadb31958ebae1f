// One variant of the indexer_kl backward kernel (bwd_kernel.cuh): float32 atomic d_index_k.
#include "../bwd_kernel.cuh"

INDEXER_BWD_INSTANTIATE(64, 32, false)
