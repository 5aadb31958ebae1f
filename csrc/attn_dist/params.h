// Plain data handed from the attn_dist FFI handler to its launcher.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace attn_dist {

namespace dist {
// out[g] sums the probabilities of heads 64g .. 64g+63.
constexpr int kHeadsPerGroup = 64;
}  // namespace dist

// attn_dist (docs/SPEC.md §2) in the canonical batched, row-major form:
//   q [B, S, H, D] bf16, k [B, N, 1, D] bf16, indices [B, S, 1, T] int32,
//   lse [B, S, H] f32, q_start [B] int32, optional row_ranges [B, S, 3] int32
//   ->  out [B, G, S, T] f32.
struct AttnDistParams {
  int batch, s_q, s_kv, h_q, d_qk, topk;
  int num_groups;          // G = ceil(H / 64)

  bool causal;
  bool lse_base_e;         // lse is a natural-log LSE (else base 2)
  int k_stride;            // causal rule: i <= floor((q_start + s + 1 - k_stride) / k_stride)
  float scale_log2;        // sm_scale * log2(e): p = exp2(acc * scale_log2 - lse_2)
  bool prefetch_next_cta;  // set by the launcher: ask L2 for the next CTA's inputs (attn_dist/kernel.cuh)

  const void* q;           // cutlass::bfloat16_t
  const void* k;           // cutlass::bfloat16_t
  const int32_t* indices;
  const float* lse;
  const int32_t* q_start;  // device scalar per batch row; may come from a traced value
  const int32_t* row_ranges;  // [B, S, 3] SPEC §6 per-row ranges (common/slot_validity.cuh), or nullptr
  float* out;
};

// Launch on `stream`; never synchronise, never allocate. On failure `detail`
// says why (a static string, one from cudaGetErrorString, or one kept per
// thread until the next failure). Dispatches to the compiled variant
// (attn_dist/launch.cu).
LaunchStatus run_attn_dist(const AttnDistParams& params, cudaStream_t stream, const char** detail);

}  // namespace attn_dist
