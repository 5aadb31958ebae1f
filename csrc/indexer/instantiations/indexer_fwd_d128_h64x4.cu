#include "../kernel.cuh"

INDEXER_FWD_INSTANTIATE(128, 64, 4)
