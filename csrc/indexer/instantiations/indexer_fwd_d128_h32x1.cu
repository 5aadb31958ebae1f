#include "../kernel.cuh"

INDEXER_FWD_INSTANTIATE(128, 32, 1)
