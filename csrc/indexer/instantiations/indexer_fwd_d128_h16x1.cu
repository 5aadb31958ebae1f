#include "../kernel.cuh"

INDEXER_FWD_INSTANTIATE(128, 16, 1)
