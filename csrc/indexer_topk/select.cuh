// The selection steps of the indexer_topk kernel: one consumer warpgroup
// (128 threads) selects one query row's keys from their logits in shared
// memory (docs/KERNELS.md, "indexer_topk: selection").
//
// A logit is compared as its order key (order_key): a uint32 whose unsigned
// order is the float order. The cut is found by radix rounds over those keys:
// a histogram of the next kHistBits unknown bits of the keys that match the
// known prefix, then the bin where the count from the top reaches the number
// still needed. After the rounds either every key that matches the prefix is
// taken (need == count: take order key >= prefix) or the prefix is the exact
// cut value T (take > T, then the first `need` keys equal to T in key order,
// the smaller keys first). The output is written in ascending key order by a
// prefix count over key order. Counts are integers and every sum has a fixed
// order, so the result is deterministic.
#pragma once

#include <cstdint>

#include "config.h"

namespace attn_dist {
namespace indexer_topk {

// The float order as unsigned order: -inf < ... < -0 == +0 < ... < +inf <
// NaN (every NaN the same key, above +inf).
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t b = __float_as_uint(x);
  if (x != x) return 0xFFFFFFFFu;
  if (b == 0x80000000u) b = 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Named barrier of consumer warpgroup r (row r's selection).
__device__ __forceinline__ void row_sync(int r) {
  asm volatile("bar.sync %0, %1;" ::"r"(kBarRow0 + r), "n"(kWarpgroupThreads) : "memory");
}

// The radix state of one row, the same in every thread of its warpgroup.
struct RowSelect {
  uint32_t prefix;  // the known high bits of the cut (its low `low_bits` bits are 0)
  int low_bits;     // bits of the cut not yet known, 0 .. 32
  uint32_t need;    // keys still to take among those that match the prefix (>= 1)
  uint32_t count;   // keys that match the prefix

  // Before the first round: no bit of the cut known; `need` of the `count`
  // keys to take.
  static __device__ __forceinline__ RowSelect first_round(uint32_t need, uint32_t count) {
    RowSelect s;
    s.prefix = 0u, s.low_bits = 32, s.need = need, s.count = count;
    return s;
  }
  __device__ __forceinline__ bool done() const { return need == count || low_bits == 0; }
  // The known high bits as a mask (0 before the first round): a key matches
  // the prefix where ((u ^ prefix) & known_mask()) == 0.
  __device__ __forceinline__ uint32_t known_mask() const { return low_bits >= 32 ? 0u : ~0u << low_bits; }
  __device__ __forceinline__ int shift() const { return low_bits > kHistBits ? low_bits - kHistBits : 0; }
};

// Where the output of a row stands after the keys emitted so far.
struct EmitCursor {
  uint32_t above = 0;  // keys taken because they are above the cut
  uint32_t equal = 0;  // keys equal to the cut seen (exact mode)
  int parity = 0;      // which warp_sums buffer the next tile uses
};

// A row that needs no selection (span <= topk): its keys, then -1.
__device__ __forceinline__ void write_all_keys(int32_t* out, uint32_t begin, uint32_t span, int topk, int t) {
  for (int j = t; j < topk; j += kWarpgroupThreads) out[j] = uint32_t(j) < span ? int32_t(begin + uint32_t(j)) : -1;
}

// Visits the order keys u[a, e) strided over the warpgroup (thread t: a + t,
// a + t + 128, ...) in steps of kLoadsInFlight keys a thread, their loads
// issued before their uses: f(v, in) with the step's keys, where a lane's key
// past e gets in = false (and v = 0). Every lane of a warp runs the same
// steps, so that f may vote across the warp.
constexpr int kLoadsInFlight = 4;
template <class F>
__device__ __forceinline__ void for_each_step(const uint32_t* u, int a, int e, int t, F&& f) {
  constexpr int kStride = kWarpgroupThreads;
  const int lane = t % 32;
  int i = a + t - lane;  // the warp's first key of a step (warp-uniform)
  // Steps whose keys are all below e: no key's bound tested.
  for (; i + (kLoadsInFlight - 1) * kStride + 32 <= e; i += kLoadsInFlight * kStride) {
    uint32_t v[kLoadsInFlight];
    bool in[kLoadsInFlight];
    CUTE_UNROLL
    for (int r = 0; r < kLoadsInFlight; ++r) v[r] = u[i + lane + r * kStride], in[r] = true;
    f(v, in);
  }
  for (; i < e; i += kLoadsInFlight * kStride) {
    uint32_t v[kLoadsInFlight];
    bool in[kLoadsInFlight];
    CUTE_UNROLL
    for (int r = 0; r < kLoadsInFlight; ++r) {
      const int k = i + lane + r * kStride;
      in[r] = k < e;
      v[r] = in[r] ? u[k] : 0u;
    }
    f(v, in);
  }
}

// The same keys one at a time: f(v, in).
template <class F>
__device__ __forceinline__ void for_each_key(const uint32_t* u, int a, int e, int t, F&& f) {
  for_each_step(u, a, e, t, [&](const uint32_t(&v)[kLoadsInFlight], const bool(&in)[kLoadsInFlight]) {
    CUTE_UNROLL
    for (int r = 0; r < kLoadsInFlight; ++r) f(v[r], in[r]);
  });
}

// *p += v in shared memory, with no branch around it. (An increment by the
// constant 1 under a condition, atomicAdd(p, 1) or a predicated red, compiles
// to a warp-aggregated increment inside a convergence region per key, which
// made each histogram pass several times slower than a plain pass.)
__device__ __forceinline__ void shared_add(uint32_t* p, uint32_t v) {
  asm volatile("red.shared.add.u32 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "r"(v)
               : "memory");
}

// *p = v in global memory where pred holds: a predicated store, no branch.
__device__ __forceinline__ void global_store_if(int32_t* p, int32_t v, bool pred) {
  asm volatile(
      "{\n"
      " .reg .pred q;\n"
      " setp.ne.b32 q, %2, 0;\n"
      " @q st.global.b32 [%0], %1;\n"
      "}\n" ::"l"(static_cast<uint64_t>(__cvta_generic_to_global(p))),
      "r"(v), "r"(int(pred))
      : "memory");
}

// Adds the order keys u[a, e) that match the prefix to the row's histogram
// of the next digit. In the first round every key counts. After it, a warp
// whose keys of a step all miss the prefix (most steps, past the second
// round) skips the step's additions by one vote; where one lane matches,
// every lane adds each of its keys (0 where it misses).
__device__ __forceinline__ void hist_add(uint32_t* hist, const uint32_t* u, int a, int e, const RowSelect& s, int t) {
  if (s.low_bits == 32) {
    for_each_key(u, a, e, t, [&](uint32_t v, bool in) { shared_add(hist + (v >> (32 - kHistBits)), uint32_t(in)); });
    return;
  }
  const int shift = s.shift();
  const uint32_t mask = (1u << (s.low_bits - shift)) - 1u, known = s.known_mask(), prefix = s.prefix;
  for_each_step(u, a, e, t, [&](const uint32_t(&v)[kLoadsInFlight], const bool(&in)[kLoadsInFlight]) {
    bool m[kLoadsInFlight], any = false;
    CUTE_UNROLL
    for (int r = 0; r < kLoadsInFlight; ++r) m[r] = in[r] && ((v[r] ^ prefix) & known) == 0u, any |= m[r];
    if (__any_sync(0xffffffffu, any)) {
      CUTE_UNROLL
      for (int r = 0; r < kLoadsInFlight; ++r) shared_add(hist + ((v[r] >> shift) & mask), uint32_t(m[r]));
    }
  });
}

// Visits u[lo, hi), a thread's segment of consecutive keys, in order, four
// loads issued before their uses: f(v, i).
template <class F>
__device__ __forceinline__ void for_each_segment_key(const uint32_t* u, int lo, int hi, F&& f) {
  int i = lo;
  for (; i + kLoadsInFlight <= hi; i += kLoadsInFlight) {
    uint32_t v[kLoadsInFlight];
    CUTE_UNROLL
    for (int r = 0; r < kLoadsInFlight; ++r) v[r] = u[i + r];
    CUTE_UNROLL
    for (int r = 0; r < kLoadsInFlight; ++r) f(v[r], i + r);
  }
  for (; i < hi; ++i) f(u[i], i);
}

// x summed over the warp's lanes up to this one.
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t x, int lane) {
  CUTE_UNROLL
  for (int m = 1; m < 32; m <<= 1) {
    const uint32_t o = __shfl_up_sync(0xffffffffu, x, m);
    if (lane >= m) x += o;
  }
  return x;
}

// A count per thread of warpgroup r, scanned: base plus the counts of the
// threads before it, and the total of all 128 (one barrier; sums: the warps'
// totals, which a caller calling again before another barrier
// double-buffers).
struct WarpgroupScan {
  uint32_t before, total;
};
__device__ __forceinline__ WarpgroupScan warpgroup_scan(uint32_t own, uint32_t (&sums)[4][2], int r, int t,
                                                        uint32_t base = 0u) {
  const int lane = t % 32, warp = t / 32;
  const uint32_t incl = warp_inclusive_sum(own, lane);
  if (lane == 31) sums[warp][0] = incl;
  row_sync(r);
  uint32_t before = base + incl - own, total = 0;
  CUTE_UNROLL
  for (int w = 0; w < 4; ++w) {
    const uint32_t x = sums[w][0];
    if (w < warp) before += x;
    total += x;
  }
  return {before, total};
}

// After a round's hist_add calls: the digit of the cut, and the histogram
// cleared for the next round.
template <class Plan>
__device__ __forceinline__ void hist_resolve(Plan& plan, RowSelect& s, int r, int t) {
  uint32_t* hist = plan.hist[r];
  const int shift = s.shift();
  const int bins = 1 << (s.low_bits - shift);
  const int per = bins >= kWarpgroupThreads ? bins / kWarpgroupThreads : 1;
  row_sync(r);  // every hist_add landed
  // Thread t owns the bins t * per .. (t + 1) * per - 1 counted from the top,
  // and adds them in a rotated order: at 16 bins a thread, a warp's reads in
  // order would fall on two banks; rotated by t + t / 16 on 32 (integer sums:
  // the order does not change them).
  uint32_t own = 0;
  for (int k = 0; k < per; ++k) {
    const int j = t * per + ((k + t + (t >> 4)) & (per - 1));
    if (j < bins) own += hist[bins - 1 - j];
  }
  // warpgroup_scan's steps, but only the warps before this one summed: with
  // warpgroup_scan (all four read, and the total) the multi-pass kernels
  // spill 12 bytes (ptxas).
  const int lane = t % 32, warp = t / 32;
  const uint32_t incl = warp_inclusive_sum(own, lane);
  if (lane == 31) plan.warp_sums[r][0][warp][0] = incl;
  row_sync(r);
  uint32_t excl = incl - own;
  for (int w = 0; w < warp; ++w) excl += plan.warp_sums[r][0][w][0];
  if (excl < s.need && s.need <= excl + own) {  // exactly one thread: 1 <= need <= count
    uint32_t above = excl;
    for (int k = 0; k < per; ++k) {
      const int bin = bins - 1 - (t * per + k);
      const uint32_t c = hist[bin];
      if (above + c >= s.need) {
        plan.found[r][0] = uint32_t(bin), plan.found[r][1] = above, plan.found[r][2] = c;
        break;
      }
      above += c;
    }
  }
  row_sync(r);
  s.prefix |= plan.found[r][0] << shift;
  s.need -= plan.found[r][1];
  s.count = plan.found[r][2];
  s.low_bits = shift;
  for (int j = t; j < bins; j += kWarpgroupThreads) hist[j] = 0u;
  row_sync(r);  // cleared, and found read, before the next round
}

// Writes the selected keys among u[a, e) (key = key_base + index) to the
// row's output, in key order after those of earlier calls (cur). Thread t
// takes a segment of consecutive keys (an odd length, so that the threads'
// reads fall on distinct banks): it counts its taken keys, a scan over the
// warpgroup gives each segment its first position, and a second sweep of the
// segment writes them. One barrier a call.
template <class Plan>
__device__ __forceinline__ void emit_keys(Plan& plan, const uint32_t* u, int a, int e, uint32_t key_base,
                                          const RowSelect& s, EmitCursor& cur, int32_t* out, int topk, int r,
                                          int t) {
  // A key is above the cut where v > prefix, or v == prefix when every key
  // of the prefix is taken (need == count); else v == prefix is a tie at the
  // exact cut, of which the first `need` in key order are taken.
  const bool take_prefix = s.need == s.count;
  const uint32_t prefix = s.prefix;
  const int len = ((e - a + kWarpgroupThreads - 1) / kWarpgroupThreads) | 1;
  const int lo = min(a + t * len, e), hi = min(lo + len, e);
  // Both counts in one word, above in the high half: a call sees at most
  // kChunkKeys keys, so neither passes 2^16.
  static_assert(kChunkKeys < (1 << 16), "a chunk's counts must fit 16 bits");
  const uint32_t equal_count = take_prefix ? 1u << 16 : 1u;
  uint32_t own = 0;
  for_each_segment_key(u, lo, hi, [&](uint32_t v, int) {
    own += (v > prefix ? 1u << 16 : 0u) + (v == prefix ? equal_count : 0u);
  });
  const WarpgroupScan scan = warpgroup_scan(own, plan.warp_sums[r][cur.parity], r, t);
  uint32_t above_before = cur.above + (scan.before >> 16), equal_before = cur.equal + (scan.before & 0xFFFFu);
  cur.above += scan.total >> 16;
  cur.equal += scan.total & 0xFFFFu;
  cur.parity ^= 1;  // the other buffer next call: one barrier per call suffices
  // The segment's taken keys go to consecutive positions from its first;
  // ties_left: the ties it may still take (all, where the prefix is taken).
  uint32_t pos = above_before + min(equal_before, s.need);
  uint32_t ties_left = take_prefix ? 0xFFFFFFFFu : s.need - min(equal_before, s.need);
  // The row's output as an opaque pointer, so that each key's address is one
  // scaled add to it rather than 64-bit index arithmetic from the row's start.
  asm("" : "+l"(out));
  for_each_segment_key(u, lo, hi, [&](uint32_t v, int i) {
    const bool tie = v == prefix && ties_left != 0u;
    const bool take = v > prefix || tie;
    global_store_if(out + pos, int32_t(key_base + uint32_t(i)), take && pos < uint32_t(topk));
    pos += take;
    ties_left -= tie;
  });
}

// ---------------------------------------------------------------------------
// Streaming selection (kernel.cuh): a row's candidates, cut back to its topk
// best as they fill, then written in key order.
// ---------------------------------------------------------------------------

// Appends (v, key) to a row's candidates where take holds: one shared atomic
// a warp (its lanes' slots in lane order). Warp-uniform call.
__device__ __forceinline__ void append_candidate(uint32_t* cand_u, uint32_t* cand_key, uint32_t* count, bool take,
                                                 uint32_t v, uint32_t key, int lane) {
  const uint32_t takes = __ballot_sync(0xffffffffu, take);
  if (takes == 0u) return;
  const int leader = __ffs(takes) - 1;
  uint32_t base = 0u;
  if (lane == leader) base = atomicAdd(count, uint32_t(__popc(takes)));
  base = __shfl_sync(0xffffffffu, base, leader);
  if (take) {
    const uint32_t at = base + uint32_t(__popc(takes & ((1u << lane) - 1u)));
    cand_u[at] = v;
    cand_key[at] = key;
  }
}

// The radix histogram of the ties at the exact cut (candidates whose order
// key is `cut`), over ~key: the ties to take are those with the smallest keys,
// the largest ~key. Candidates are in no particular order, so that the key
// index, not the position, decides.
__device__ __forceinline__ void tie_hist_add(uint32_t* hist, const uint32_t* cand_u, const uint32_t* cand_key,
                                             uint32_t n, uint32_t cut, const RowSelect& s, int t) {
  const int shift = s.shift();
  const uint32_t mask = (1u << (s.low_bits - shift)) - 1u, known = s.known_mask(), prefix = s.prefix;
  for (uint32_t i = t; i < n; i += kWarpgroupThreads) {
    const uint32_t w = ~cand_key[i];
    const bool counts = cand_u[i] == cut && ((w ^ prefix) & known) == 0u;
    shared_add(hist + ((w >> shift) & mask), uint32_t(counts));
  }
}

// Cuts row r's n > topk candidates back to its topk best (larger order key
// first, then the smaller key), in place, and sets the row's cut: a key that
// comes later (a larger index) belongs to the row's topk only if its order
// key is above the cut (the topk-th best's, or a value at or below it).
// Warpgroup r alone; its histogram is clear on entry and on return.
template <class Plan, class Candidates>
__device__ __forceinline__ void compact_candidates(Plan& plan, Candidates& cand, int r, uint32_t topk, int t) {
  uint32_t* cand_u = cand.u[r];
  uint32_t* cand_key = cand.key[r];
  const uint32_t n = cand.count[r];
  RowSelect s = RowSelect::first_round(topk, n);
  while (!s.done()) {  // (n > topk: at least one round, whose barriers order every read of n before the reset)
    hist_add(plan.hist[r], cand_u, 0, int(n), s, t);
    hist_resolve(plan, s, r, t);
  }
  // Take order key > cut, and = cut where ~key >= tie_cut: every candidate
  // of the prefix's bin where need == count (tie_cut 0), else (the exact cut
  // value) the `need` ties with the smallest keys (keys are distinct).
  const uint32_t cut = s.prefix;
  uint32_t tie_cut = 0u;
  if (s.need != s.count) {
    RowSelect ties = RowSelect::first_round(s.need, s.count);
    while (!ties.done()) {
      tie_hist_add(plan.hist[r], cand_u, cand_key, n, cut, ties, t);
      hist_resolve(plan, ties, r, t);
    }
    tie_cut = ties.prefix;
  }
  if (t == 0) cand.count[r] = 0u;
  // In place, kLoadsInFlight * 128 candidates at a time: all of a group read
  // before any is written; a write lands below the group's end (no more are
  // taken than read so far), never on a candidate not yet read.
  const int lane = t % 32;
  for (uint32_t base = 0; base < n; base += kLoadsInFlight * kWarpgroupThreads) {
    uint32_t v[kLoadsInFlight], key[kLoadsInFlight];
    bool take[kLoadsInFlight];
    CUTE_UNROLL
    for (int k = 0; k < kLoadsInFlight; ++k) {
      const uint32_t i = base + uint32_t(t + k * kWarpgroupThreads);
      const bool in = i < n;
      v[k] = in ? cand_u[i] : 0u;
      key[k] = in ? cand_key[i] : 0u;
      take[k] = in && (v[k] > cut || (v[k] == cut && ~key[k] >= tie_cut));
    }
    row_sync(r);  // the group read (and, the first time, the count reset)
    CUTE_UNROLL
    for (int k = 0; k < kLoadsInFlight; ++k)
      append_candidate(cand_u, cand_key, &cand.count[r], take[k], v[k], key[k], lane);
  }
  if (t == 0) cand.cut[r] = cut;
  row_sync(r);  // every candidate placed
}

// Writes row r's topk candidates (distinct keys of [begin, begin + span)) to
// its output in ascending key order: a bitmap of the keys, a window of
// 32 * kHistBins keys at a time, in the row's histogram (clear on entry; left
// clear), each thread taking a run of consecutive words, a scan over the
// warpgroup giving each run its first position.
template <class Plan, class Candidates>
__device__ __forceinline__ void emit_candidates_in_order(Plan& plan, const Candidates& cand, int r, uint32_t begin,
                                                         uint32_t span, uint32_t topk, int32_t* out, int t) {
  constexpr uint32_t kWindow = 32u * kHistBins;
  constexpr int kRun = kHistBins / kWarpgroupThreads;  // words a thread
  uint32_t* bits = plan.hist[r];
  const uint32_t* cand_key = cand.key[r];
  uint32_t written = 0u;
  for (uint32_t w0 = 0; w0 < span; w0 += kWindow) {
    for (uint32_t i = t; i < topk; i += kWarpgroupThreads) {
      const uint32_t rel = cand_key[i] - begin - w0;
      if (rel < kWindow) atomicOr(&bits[rel >> 5], 1u << (rel & 31u));
    }
    row_sync(r);  // the window's bits set
    uint32_t own = 0u;
    CUTE_UNROLL
    for (int j = 0; j < kRun; ++j) own += uint32_t(__popc(bits[t * kRun + j]));
    const WarpgroupScan scan = warpgroup_scan(own, plan.warp_sums[r][0], r, t, written);
    uint32_t pos = scan.before;
    for (int j = 0; j < kRun; ++j) {
      const uint32_t word0 = begin + w0 + uint32_t(t * kRun + j) * 32u;
      for (uint32_t b = bits[t * kRun + j]; b != 0u; b &= b - 1u) out[pos++] = int32_t(word0 + uint32_t(__ffs(b) - 1));
    }
    written += scan.total;
    row_sync(r);  // the bits and sums read
    for (int j = 0; j < kRun; ++j) bits[t * kRun + j] = 0u;
    row_sync(r);  // cleared before the next window's bits
  }
}

}  // namespace indexer_topk
}  // namespace attn_dist
