#include "../kernel.cuh"

INDEXER_FWD_INSTANTIATE(64, 32, 1)
