// L2 prefetches of the inputs a CTA's successor will read first.
//
// The kernels run one CTA per query row (and head tile), in blockIdx order,
// `resident` CTAs at a time. A CTA's first reads (its slot indices, query
// rows, lse or weights) come cold from HBM, and until they land its SM's
// pipeline stands partly idle (attn_dist runs one CTA per SM: nothing covers
// the wait). So each CTA asks L2 for the rows of blockIdx + resident, the CTA
// that takes its place next, with bulk prefetches: no registers, no wait.
#pragma once

#include <cstdint>

namespace attn_dist {

// Asks L2 to fetch bytes [begin, end) of a `size`-byte global buffer (whole
// 16-byte units inside it only).
__device__ __forceinline__ void prefetch_to_l2(const void* buffer, int64_t size, int64_t begin, int64_t end) {
  begin = begin / 16 * 16;
  end = min((end + 15) / 16 * 16, size / 16 * 16);
  if (end > begin)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const char*>(buffer) + begin),
                 "r"(uint32_t(end - begin))
                 : "memory");
}

// Elements [first, first + count) of a `total`-element array of T.
template <class T>
__device__ __forceinline__ void prefetch_elems_to_l2(const T* buffer, int64_t total, int64_t first, int64_t count) {
  const int64_t bytes = int64_t(sizeof(T));
  prefetch_to_l2(buffer, total * bytes, first * bytes, (first + count) * bytes);
}

__device__ __forceinline__ int num_sms() {
  uint32_t n;
  asm("mov.u32 %0, %%nsmid;" : "=r"(n));
  return int(n);
}

// The CTAs of a grid that run at once when `ctas_per_sm` fit on each SM.
// (%nsmid may exceed the SM count where SM ids are not contiguous; then the
// "next" CTA is a little off, which costs a prefetch hint, nothing else.)
__device__ __forceinline__ int resident_ctas(int ctas_per_sm) { return num_sms() * ctas_per_sm; }

}  // namespace attn_dist
