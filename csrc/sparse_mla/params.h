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

namespace attn_dist {

// The sparse MLA backward (docs/SPEC.md §8.3), canonical form as the forward's,
// plus the forward's out [B, S, H, d_v] bf16 and lse [B, S, H] f32 and the
// cotangents dout [B, S, H, d_v] bf16 and dlse [B, S, H] f32
//   ->  dq [B, S, H, D] bf16 and dkv [B, N, 1, D] f32.
// The workspace (XLA allocates it; sparse_mla/ffi.cc lays it out):
//   row_delta [B, S, H] f32: rowsum(dout * out) - dlse in base e, per head;
//   deterministic mode only: dkv_fixed [B, N, D] int64, the fixed-point sums
//   (common/fixed_point.cuh), and per batch element two words, as float
//   bits: kv_max_bits [B] (max |kv|) and bound_bits [B] (the largest bound
//   of its rows on their dkv terms), from which its scale is chosen with
//   scale_rows; flag_bits [B], where a non-finite or out-of-bound term is
//   recorded (bound_bits itself in one call; apart from it when the rows are
//   sharded and bound_bits is every shard's maximum, read-only).
struct SparseMlaBwdParams {
  int batch, s_q, s_kv, h_q, d_qk, d_v, topk;

  bool causal;
  bool lse_base_e;  // lse (and dlse) are natural-log (else base 2)
  int k_stride;
  float sm_scale;
  float scale_log2;  // sm_scale * log2(e)

  const void* q;           // cutlass::bfloat16_t
  const void* kv;          // cutlass::bfloat16_t
  const int32_t* indices;
  const int32_t* q_start;
  const int32_t* row_ranges;  // or nullptr
  const void* out;         // cutlass::bfloat16_t
  const float* lse;
  const void* dout;        // cutlass::bfloat16_t
  const float* dlse;

  void* dq;                // cutlass::bfloat16_t
  float* dkv;
  float* row_delta;
  long long* dkv_fixed;    // nullptr: float32 atomics into dkv
  unsigned int* kv_max_bits;  // [B]
  unsigned int* bound_bits;   // [B]
  unsigned int* flag_bits;    // [B]
  int64_t scale_rows;         // the rows the scale is chosen for: s_q, or every shard's
};

// Launches the row preprocess, the main kernel and (deterministic) the
// bound and conversion kernels on `stream`; zeroes what they accumulate
// into first. Never synchronises or allocates (sparse_mla/bwd_launch.cu).
LaunchStatus run_sparse_mla_bwd(const SparseMlaBwdParams& params, cudaStream_t stream, const char** detail);

// The deterministic backward split around the all-reduces of a sharded call
// (rows sharded over devices; jax_attn_dist/ops/sparse_mla/sharded_fixed_point.py):
// first the row terms and the scale words kv_max_bits and bound_bits
// (zeroed here), whose maximum over the shards then sets every shard's
// scale; then, given those, dq and this shard's fixed-point sums (dkv_fixed
// and flag_bits zeroed here) as limbs [3, B, N * D] and flags [B]
// (fixed_point/limbs.h), for the shards' limbs to be added and converted.
LaunchStatus run_sparse_mla_bwd_bound(const SparseMlaBwdParams& params, cudaStream_t stream, const char** detail);
LaunchStatus run_sparse_mla_bwd_fixed(const SparseMlaBwdParams& params, int32_t* limbs, int32_t* flags,
                                      cudaStream_t stream, const char** detail);

}  // namespace attn_dist
