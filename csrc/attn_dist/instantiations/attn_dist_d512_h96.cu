#include "../kernel.cuh"

ATTN_DIST_INSTANTIATE(512, 96)
