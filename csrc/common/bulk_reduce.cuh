// Bulk reductions from shared memory into global memory: the copy engine
// adds a staged row (a multiple of 16 bytes, 16-byte aligned at both ends)
// into global memory in whole L2 lines, tracked by the issuing thread's bulk
// group. Used by the indexer backward (its d_index_k rows, float32 and
// fixed-point).
#pragma once

#include <cstdint>

namespace attn_dist {

__device__ __forceinline__ void reduce_row_async(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
               "r"(uint32_t(__cvta_generic_to_shared(src))), "r"(bytes)
               : "memory");
}
// The same for fixed-point integers (two's complement: u64 addition is s64's).
__device__ __forceinline__ void reduce_row_async(long long* dst, const long long* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;" ::"l"(dst),
               "r"(uint32_t(__cvta_generic_to_shared(src))), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void commit_reductions() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// The thread's reductions, all but the newest kPending groups, have read
// their shared source (it may be rewritten).
template <int kPending = 0>
__device__ __forceinline__ void wait_reductions_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// The thread's reductions are complete.
__device__ __forceinline__ void wait_reductions() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace attn_dist
