// Fixed-point sums across devices (common/fixed_point_limbs.cuh): a device's
// int64 sums to limbs, and the limbs added over the devices back to float32.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace attn_dist {

// Each of `groups` groups of `per_group` int64 sums (one fixed-point scale per
// group) as limbs, limb-major: limbs[k][g][i] (int32 [3, groups, per_group]);
// flags[g] = 1 where flag_bits[g] recorded a non-finite or out-of-bound term,
// else 0 (so that flags, too, add over the devices).
LaunchStatus launch_fixed_to_limbs(const long long* sums, const unsigned* flag_bits, int groups, int64_t per_group,
                                   int32_t* limbs, int32_t* flags, cudaStream_t stream, const char** detail);

// out[g][i] = the rejoined limb sum * 2^-F, F from group g's bound bits and
// `rows` (fixed_point_scale); NaN over a group whose bound is not finite or
// whose flag sum is not 0.
LaunchStatus launch_limbs_to_float(const int32_t* limbs, const int32_t* flags, const int32_t* bound_bits, int groups,
                                   int64_t per_group, int64_t rows, float* out, cudaStream_t stream,
                                   const char** detail);

}  // namespace attn_dist
