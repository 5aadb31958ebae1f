// The scores product both sparse MLA kernels run on a gathered key block:
// acc = A.K^T over the block's dim tiles, heads x 64 keys, both operands
// K-major in shared memory (A: Q, or dO in the backward).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/gather.cuh"

namespace attn_dist {
namespace sparse_mla {

// Over the first size<2>(LayoutA) dim tiles: waits for A's tile (TMA, before
// the first block only) and the key stage (`key_full[dt]`, this block's
// phase), then issues its WGMMAs; committed, not waited for.
template <class Mma, class LayoutA, class LayoutK, class Acc>
__device__ __forceinline__ void issue_block_scores(const bf16* a_smem, uint64_t* a_ready, const bf16* k_smem,
                                                   uint64_t* key_full, uint32_t phase, bool first_block, Acc& acc,
                                                   int thread) {
  using namespace cute;
  constexpr int kTiles = size<2>(LayoutA{});
  Mma mma;
  auto thr = mma.get_slice(thread);
  Tensor tA = thr.partition_fragment_A(make_tensor(make_smem_ptr(a_smem), LayoutA{}));  // (64, 64, kTiles)
  Tensor tK = thr.partition_fragment_B(make_tensor(make_smem_ptr(k_smem), LayoutK{}));  // (64, 64, D/64)
  warpgroup_fence_operand(acc);
  CUTE_UNROLL
  for (int dt = 0; dt < kTiles; ++dt) {
    if (first_block) cutlass::arch::ClusterTransactionBarrier::wait(&a_ready[dt], 0);
    cutlass::arch::ClusterBarrier::wait(&key_full[dt], phase);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tA); ++kb) {
      mma.accumulate_ = dt == 0 && kb == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      cute::gemm(mma, tA(_, _, kb, dt), tK(_, _, kb, dt), acc);
    }
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

}  // namespace sparse_mla
}  // namespace attn_dist
