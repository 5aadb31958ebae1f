// Distributed shared memory between the two CTAs of a cluster (SM90): stores
// into the other CTA's shared memory, and mbarrier arrivals and waits whose
// ordering spans the cluster (CUTLASS's ClusterBarrier orders only within a
// CTA: its remote arrive releases at CTA scope).
#pragma once

#include <cstdint>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/util.hpp>

namespace attn_dist {

// The shared::cluster address of a variable of this CTA's shared-memory plan
// in CTA `rank` of the cluster (both CTAs run the same kernel, so the plan
// lies at the same offset in each).
__device__ __forceinline__ uint32_t cluster_address(const void* local, uint32_t rank) {
  return cute::set_block_rank(cute::cast_smem_ptr_to_uint(local), rank);
}

__device__ __forceinline__ void store_cluster_f32x4(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

// `count` arrivals on an mbarrier of another CTA (its cluster address),
// releasing this thread's earlier memory operations at cluster scope. After a
// __syncwarp, one lane's arrival releases its warp's operations too.
__device__ __forceinline__ void arrive_cluster(uint32_t barrier, uint32_t count) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0], %1;" ::"r"(barrier), "r"(count)
               : "memory");
}

// Waits until the phase of this CTA's mbarrier with the given parity has
// completed, acquiring what the arriving threads (of either CTA) released.
__device__ __forceinline__ void wait_cluster(const uint64_t* barrier, uint32_t parity) {
  const uint32_t addr = cute::cast_smem_ptr_to_uint(barrier);
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "WAIT:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra WAIT;\n}" ::"r"(addr),
      "r"(parity)
      : "memory");
}

}  // namespace attn_dist
