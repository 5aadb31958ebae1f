#include "../kernel.cuh"

ATTN_DIST_INSTANTIATE(576, 96)
