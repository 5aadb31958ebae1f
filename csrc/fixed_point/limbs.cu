// The fixed-point limb kernels (limbs.h): elementwise, grid-strided.
#include <algorithm>

#include "../common/fixed_point.cuh"
#include "../common/fixed_point_limbs.cuh"
#include "../common/host.h"
#include "limbs.h"

namespace attn_dist {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxCtas = 4096;  // a few waves; each CTA strides the rest
constexpr int kMaxGridY = 65535;

dim3 limb_grid(int64_t per_group, int groups) {
  const int y = std::min(groups, kMaxGridY);
  const int64_t max_x = std::max<int64_t>(kMaxCtas / y, 1);
  const int64_t x = std::clamp<int64_t>((per_group + kThreads - 1) / kThreads, 1, max_x);
  return dim3(unsigned(x), unsigned(y));
}

__global__ void __launch_bounds__(kThreads) fixed_to_limbs_kernel(const long long* sums, const unsigned* flag_bits,
                                                                  int groups, int64_t per_group, int32_t* limbs,
                                                                  int32_t* flags) {
  const int64_t plane = int64_t(groups) * per_group;
  for (int g = blockIdx.y; g < groups; g += gridDim.y) {
    if (blockIdx.x == 0 && threadIdx.x == 0) flags[g] = flag_bits[g] != 0u ? 1 : 0;
    for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < per_group; i += int64_t(gridDim.x) * kThreads) {
      const int64_t at = int64_t(g) * per_group + i;
      int32_t low, mid, high;
      split_limbs(sums[at], low, mid, high);
      limbs[at] = low, limbs[plane + at] = mid, limbs[2 * plane + at] = high;
    }
  }
}

__global__ void __launch_bounds__(kThreads) limbs_to_float_kernel(const int32_t* limbs, const int32_t* flags,
                                                                  const int32_t* bound_bits, int groups,
                                                                  int64_t per_group, int64_t rows, float* out) {
  const int64_t plane = int64_t(groups) * per_group;
  for (int g = blockIdx.y; g < groups; g += gridDim.y) {
    const FixedPointScale s = fixed_point_scale(unsigned(bound_bits[g]), rows);
    const bool finite = s.finite && flags[g] == 0;
    for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < per_group; i += int64_t(gridDim.x) * kThreads) {
      const int64_t at = int64_t(g) * per_group + i;
      const long long sum = join_limbs(limbs[at], limbs[plane + at], limbs[2 * plane + at]);
      out[at] = finite ? __ll2float_rn(sum) * s.from_fixed : __int_as_float(0x7fc00000);
    }
  }
}

}  // namespace

LaunchStatus launch_fixed_to_limbs(const long long* sums, const unsigned* flag_bits, int groups, int64_t per_group,
                                   int32_t* limbs, int32_t* flags, cudaStream_t stream, const char** detail) {
  if (groups <= 0) return LaunchStatus::kOk;
  return launch_kernel(&fixed_to_limbs_kernel, limb_grid(per_group, groups), kThreads, 0, stream, detail, sums,
                       flag_bits, groups, per_group, limbs, flags);
}

LaunchStatus launch_limbs_to_float(const int32_t* limbs, const int32_t* flags, const int32_t* bound_bits, int groups,
                                   int64_t per_group, int64_t rows, float* out, cudaStream_t stream,
                                   const char** detail) {
  if (groups <= 0 || per_group <= 0) return LaunchStatus::kOk;
  return launch_kernel(&limbs_to_float_kernel, limb_grid(per_group, groups), kThreads, 0, stream, detail, limbs,
                       flags, bound_bits, groups, per_group, rows, out);
}

}  // namespace attn_dist
