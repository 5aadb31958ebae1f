// Plain data handed from the sparse_mla FFI handler to its launcher.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace attn_dist {

// The sparse MLA forward (docs/SPEC.md §8) in the canonical batched, row-major form:
//   q [B, S, H, D] bf16, kv [B, N, 1, D] bf16, indices [B, S, 1, T] int32,
//   q_start [B] int32, optional row_ranges [B, S, 3] int32
//   ->  out [B, S, H, d_v] bf16, lse [B, S, H] f32.
struct SparseMlaFwdParams {
  int batch, s_q, s_kv, h_q, d_qk, d_v, topk;

  bool causal;
  bool lse_base_e;         // write lse as a natural-log LSE (else base 2)
  int k_stride;            // causal rule: i <= floor((q_start + s + 1 - k_stride) / k_stride)
  float scale_log2;        // sm_scale * log2(e): scores in base 2

  const void* q;           // cutlass::bfloat16_t
  const void* kv;          // cutlass::bfloat16_t
  const int32_t* indices;
  const int32_t* q_start;     // device scalar per batch row; may come from a traced value
  const int32_t* row_ranges;  // [B, S, 3] SPEC §6 per-row ranges (common/slot_validity.cuh), or nullptr
  void* out;               // cutlass::bfloat16_t
  float* lse;
};

// Launch on `stream`; never synchronise, never allocate. On failure `detail`
// says why. Dispatches to the compiled variant (sparse_mla/launch.cu).
LaunchStatus run_sparse_mla_fwd(const SparseMlaFwdParams& params, cudaStream_t stream, const char** detail);

}  // namespace attn_dist
