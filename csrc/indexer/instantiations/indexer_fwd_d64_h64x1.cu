#include "../kernel.cuh"

INDEXER_FWD_INSTANTIATE(64, 64, 1)
