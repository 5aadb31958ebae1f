// What both sparse MLA kernels run on a gathered key block: the scores
// product acc = A.K^T over the block's dim tiles, heads x 64 keys, both
// operands K-major in shared memory (A: Q, or dO in the backward), and the
// store of a 64 x 64 accumulator (P, dS) as a bf16 WGMMA operand tile.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory.h>

#include "../common/gather.cuh"
#include "../common/timeline.cuh"

namespace attn_dist {
namespace sparse_mla {

// Over the first size<2>(LayoutA) dim tiles, from kFirstTile on and
// wrapping: waits for A's tile (TMA, before the first block only) and the key
// stage (`key_full[dt]`, this block's phase), calls on_landed(i) for the
// i-th tile visited, then issues its WGMMAs; committed, not waited for.
template <class Mma, class LayoutA, class LayoutK, int kFirstTile = 0, class Acc, class OnLanded = timeline::NoMark>
__device__ __forceinline__ void issue_block_scores(const bf16* a_smem, uint64_t* a_ready, const bf16* k_smem,
                                                   uint64_t* key_full, uint32_t phase, bool first_block, Acc& acc,
                                                   int thread, OnLanded on_landed = {}) {
  using namespace cute;
  constexpr int kTiles = size<2>(LayoutA{});
  Mma mma;
  auto thr = mma.get_slice(thread);
  Tensor tA = thr.partition_fragment_A(make_tensor(make_smem_ptr(a_smem), LayoutA{}));  // (64, 64, kTiles)
  Tensor tK = thr.partition_fragment_B(make_tensor(make_smem_ptr(k_smem), LayoutK{}));  // (64, 64, D/64)
  warpgroup_fence_operand(acc);
  CUTE_UNROLL
  for (int i = 0; i < kTiles; ++i) {
    const int dt = (i + kFirstTile) % kTiles;  // from kFirstTile on, wrapping
    if (first_block) cutlass::arch::ClusterTransactionBarrier::wait(&a_ready[dt], 0);
    cutlass::arch::ClusterBarrier::wait(&key_full[dt], phase);
    on_landed(i);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tA); ++kb) {
      mma.accumulate_ = i == 0 && kb == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      cute::gemm(mma, tA(_, _, kb, dt), tK(_, _, kb, dt), acc);
    }
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

// Visits this thread's elements of a 64 x 64 f32 accumulator (the WGMMA
// layout): f(i, rh, col) for acc(i), which is row 16 warp + lane / 4 + 8 rh,
// column col.
template <class F>
__device__ __forceinline__ void for_each_acc_element(int lane, F&& f) {
  CUTE_UNROLL
  for (int j = 0; j < kBlockTopk / 8; ++j)
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh)
      CUTE_UNROLL
      for (int e = 0; e < 2; ++e) f(4 * j + 2 * rh + e, rh, 8 * j + 2 * (lane % 4) + e);
}

// A 64 x 64 f32 accumulator as bf16 pairs into `tile` (64 x 64, K-major
// with the 128-byte swizzle, 1024-byte aligned: a SmemLayoutTile/SmemLayoutP
// operand tile). The thread holds rows row0 (= 16 warp + lane / 4) and
// row0 + 8, columns 8j + 2 (lane % 4) (+1). The swizzle (Swizzle<3,4,3>)
// puts a row's 16-byte chunk j at chunk j ^ (row % 8), and both rows share
// row0 % 8: each store's address is one xor and one add from 32-bit shared
// addresses (the swizzled generic pointers took 64-bit arithmetic per store,
// which ptxas kept in the loops). The caller fences for the async proxy
// before a WGMMA reads it.
template <class Acc>
__device__ __forceinline__ void store_acc_tile(bf16* tile, const Acc& acc, int row0, int lane) {
  static_assert(kBlockTopk == 64, "a tile row is one 128-byte swizzle row: chunks j = 0..7");
  const uint32_t base = cute::cast_smem_ptr_to_uint(tile) + uint32_t(row0) * 128u + 4u * uint32_t(lane % 4);
  const uint32_t swizzle = uint32_t(row0 % 8) << 4;
  CUTE_UNROLL
  for (int j = 0; j < kBlockTopk / 8; ++j) {
    const uint32_t at = base + ((uint32_t(j) << 4) ^ swizzle);
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int i = 4 * j + 2 * rh;
      const __nv_bfloat162 v = __floats2bfloat162_rn(acc(i), acc(i + 1));
      cutlass::arch::shared_store<4>(at + uint32_t(rh) * 8u * 128u, &v);
    }
  }
}

}  // namespace sparse_mla
}  // namespace attn_dist
