// One variant of the indexer_kl backward kernel (bwd_kernel.cuh).
#include "../bwd_kernel.cuh"

INDEXER_BWD_INSTANTIATE(128, 64)
