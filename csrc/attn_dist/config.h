// Tile constants, shared-memory plan, barriers and TMA parameters of the SM90
// attn_dist kernel.
//
// Orientation (differs from the seed design, which put heads on M): each WGMMA is
//   acc[key, head] (+)= K_tile[key, d] . Q_tile[head, d]
// with M = 64 gathered keys and N = the CTA's head tile (64, 96 or 128). Summing
// over heads is then a sum along each accumulator ROW: 16/32 adds in a
// thread's registers and two quad shuffles, in a fixed order (deterministic),
// instead of a column reduction with shared-memory atomics. It also lets one
// CTA serve 128 heads, so each token's K rows are gathered once, not once per
// 64-head group.
#pragma once

#include <cstdint>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "../common/gather.cuh"
#include "params.h"

namespace attn_dist {
namespace dist {

constexpr int kNumConsumers = 2;    // WG0 takes the even key blocks, WG1 the odd ones
// Two producer warpgroups (WG2, WG3) feed the rings: with one, the gather held
// back every head tile. A second took 1-6 % off v32-h128 and v32-h64 in A/Bs
// on an H100: ncu shows one more warp per scheduler to hide the gather's
// latency, at the same issue rate. Four were slower (docs/PERFORMANCE.md,
// "Design decisions"; the warp roles: docs/KERNELS.md).
constexpr int kProducerWarpgroups = 2;
constexpr int kProducerThreads = kProducerWarpgroups * kWarpgroupThreads;
constexpr int kThreads = kNumConsumers * kWarpgroupThreads + kProducerThreads;
constexpr int kCtasPerSm = 1;       // Q and the two rings take the SM's shared memory

// setmaxnreg budgets within the launch allocation (__launch_bounds__(512,
// kCtasPerSm): 128 a thread). (ptxas -v: no spills at these counts, HT = 64,
// 96 and 128.)
constexpr int kConsumerRegs = 168;
constexpr int kProducerRegs = 88;
static_assert(register_budgets_fit(kThreads, kCtasPerSm, kNumConsumers * kWarpgroupThreads, kConsumerRegs,
                                   kProducerThreads, kProducerRegs),
              "setmaxnreg budgets exceed the CTA's register allocation");

// D: head dim (512 or 576). HT: heads per CTA (64, 96 or 128).
//
// HT = 96 serves 64 < H <= 96 without the masked quarter of a 128-head tile's
// tensor work (WGMMA N = 96). Its tile holds one whole 64-head group and part
// of the next, so it is valid only where one tile covers all heads
// (kTilesAlignGroups; the launcher checks).
template <int D_, int HT_>
struct Config {
  static constexpr int D = D_;
  static constexpr int HT = HT_;
  static constexpr int kDimTiles = D / kDimTile;
  static constexpr int kGroupsPerTile = (HT + kHeadsPerGroup - 1) / kHeadsPerGroup;
  static constexpr bool kTilesAlignGroups = HT % kHeadsPerGroup == 0;
  static __host__ __device__ constexpr int num_head_tiles(int heads) { return (heads + HT - 1) / HT; }
  static_assert(D % kDimTile == 0, "D must be a multiple of 64");
  static_assert(HT == 64 || HT == 96 || HT == 128, "head tile is 64, 96 or 128");
  static_assert(kGroupsPerTile <= 2, "the store gives each quad lane one (row, group) pair: at most 2 groups");

  // Q: the CTA's head tile, all D dims, K-major with the 128-byte swizzle;
  // mode 2 picks the 64-dim tile. Written by TMA (SWIZZLE_128B), read by WGMMA.
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<bf16>{},
      cute::Shape<cute::Int<HT>, cute::Int<kDimTile>, cute::Int<kDimTiles>>{}));

  static constexpr int kQBytes = HT * D * int(sizeof(bf16));
  static constexpr int kBarrierBytes = 512;
  // Each consumer has its own ring of K stages (64 keys x 64 dims); the rest of
  // shared memory after Q goes to the two rings.
  static constexpr int kStages =
      (kMaxDynamicSmem - kSmemAlign - kQBytes - kBarrierBytes) / (kNumConsumers * 64 * kDimTile * 2);
  using Ring = GatherRing<kStages, kNumConsumers, kProducerThreads / kNumConsumers>;  // a producer warpgroup a ring

  using TiledMma = KeyBlockMma<HT>;

  struct SharedMemoryPlan {
    alignas(kSmemAlign) bf16 q[cute::cosize_v<SmemLayoutQ>];
    alignas(kSmemAlign) bf16 k[kNumConsumers][Ring::kRingElems];
    typename Ring::Barriers ring;
    uint64_t q_ready[kDimTiles];  // TMA of Q's dim tile landed (one arrival + transaction bytes)
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + kSmemAlign;  // + base alignment
  static_assert(kSmemBytes <= kMaxDynamicSmem, "shared-memory plan too large");
};

// Passed by value as a __grid_constant__ kernel parameter.
struct TmaParams {
  CUtensorMap q;  // 4-D (D, H, S, B) bf16, box (64, HT, 1, 1), SWIZZLE_128B
};

}  // namespace dist
}  // namespace attn_dist
