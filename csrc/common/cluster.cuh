// Distributed shared memory between the two CTAs of a cluster (SM90): stores
// into the other CTA's shared memory that complete on its mbarrier, and
// mbarrier arrivals and waits at cluster scope (CUTLASS's ClusterBarrier
// orders only within a CTA: its remote arrive releases at CTA scope).
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

// Stores four 32-bit words into the other CTA's shared memory (`addr`, a
// cluster address) without waiting for them: their 16 bytes complete a
// transaction on the other CTA's mbarrier `barrier` (a cluster address too),
// whose wait then sees them. No fence: an arrival that releases at cluster
// scope waits for every earlier memory operation of its thread, global
// reductions included.
__device__ __forceinline__ void store_async_cluster_b32x4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                                          uint32_t d, uint32_t barrier) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   addr),
               "r"(a), "r"(b), "r"(c), "r"(d), "r"(barrier)
               : "memory");
}

// `count` arrivals on an mbarrier of another CTA (its cluster address) that
// order nothing: for signals that only say "your data was read", given after
// the reads' values are in registers.
__device__ __forceinline__ void arrive_cluster_relaxed(uint32_t barrier, uint32_t count) {
  asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0], %1;" ::"r"(barrier), "r"(count)
               : "memory");
}

// Spins on this CTA's mbarrier (%0, its shared-window address) until the
// phase with parity %1 has completed; `sem` is the wait's PTX semantics.
#define ATTN_DIST_CLUSTER_WAIT_LOOP(sem)                                      \
  "{\n\t.reg .pred p;\n"                                                   \
  "WAIT:\n\t"                                                              \
  "mbarrier.try_wait.parity." sem ".cluster.shared::cta.b64 p, [%0], %1;\n\t" \
  "@!p bra WAIT;\n}"

// Waits for the phase, acquiring nothing (the waiter only writes afterwards).
__device__ __forceinline__ void wait_cluster_relaxed(const uint64_t* barrier, uint32_t parity) {
  asm volatile(ATTN_DIST_CLUSTER_WAIT_LOOP("relaxed")::"r"(cute::cast_smem_ptr_to_uint(barrier)), "r"(parity)
               : "memory");
}

// Waits for the phase, acquiring what completed it (st.async data included).
__device__ __forceinline__ void wait_cluster(const uint64_t* barrier, uint32_t parity) {
  asm volatile(ATTN_DIST_CLUSTER_WAIT_LOOP("acquire")::"r"(cute::cast_smem_ptr_to_uint(barrier)), "r"(parity)
               : "memory");
}

#undef ATTN_DIST_CLUSTER_WAIT_LOOP

}  // namespace attn_dist
