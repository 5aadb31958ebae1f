// Plain data handed from the indexer_kl FFI handlers to their launchers.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace attn_dist {

// indexer_kl's operands (docs/SPEC.md §5), canonical batched, row-major:
//   index_q [B, S, HI, DI] bf16, index_k [B, N, DI] bf16, weights [B, S, HI] f32,
//   indices [B, S, 1, T] int32, target [B, S, T] f32, q_start [B] int32,
//   optional row_ranges [B, S, 3] int32.
// Shared by the forward and backward parameters (one FFI fill, one CTA set-up).
struct IndexerProblemParams {
  int batch, s_q, s_kv, h_idx, d_idx, topk;

  bool causal;
  int k_stride;
  float scale;             // logit = scale * sum_h weights * relu(z)

  const void* index_q;     // cutlass::bfloat16_t
  const void* index_k;     // cutlass::bfloat16_t
  const float* weights;
  const int32_t* indices;
  const float* target;
  const int32_t* q_start;
  const int32_t* row_ranges;  // [B, S, 3] SPEC §6 per-row ranges (common/slot_validity.cuh), or nullptr
};

// indexer_kl's forward: -> kl [B, S] f32, lse [B, S] f32 (log-sum-exp of the
// row's valid logits).
struct IndexerFwdParams : IndexerProblemParams {
  float* kl;
  float* lse;
};

// indexer_kl's backward (docs/SPEC.md §5.3), the forward's operands plus
//   lse [B, S] f32 (the forward's residual), g [B, S] f32 (the cotangent of kl)
//   ->  d_index_q [B, S, HI, DI] bf16, d_weights [B, S, HI] f32, and
//       d_index_k [B, N, DI] f32.
// Two ways to sum d_index_k over the slots that select a key:
// * dk_fixed == nullptr: float32 atomic additions into d_index_k, which the
//   caller zeroes first (fast; the order, so the last bits, vary run to run).
// * deterministic: every slot's term is rounded to a 64-bit fixed-point
//   integer, 2^F units per 1, and added into dk_fixed [B, N, DI] with integer
//   atomics, exact and so order-free; then d_index_k = dk_fixed * 2^-F. F is
//   set on the device from the largest per-row bound on the terms (bound_bits:
//   a float's bits, max-reduced), so nothing overflows (SPEC §5.3). The caller
//   zeroes dk_fixed and bound_bits first (one workspace, see the handler).
struct IndexerBwdParams : IndexerProblemParams {
  const float* lse;
  const float* g;
  void* d_index_q;         // cutlass::bfloat16_t
  float* d_weights;
  float* d_index_k;
  long long* dk_fixed;     // deterministic mode's accumulator, else nullptr
  unsigned int* bound_bits;
  unsigned int* flag_bits;  // a non-finite term recorded: bound_bits in one call
  int64_t scale_rows;       // the rows F is chosen for: B * S, or every shard's
  // The sharded deterministic mode's main call: bound_bits holds every
  // shard's bound already, and the sums stay fixed-point (for the shards' limbs).
  bool sums_only;
};

// Launch on `stream`; never synchronise, never allocate. On failure `detail`
// says why (a static string, one from cudaGetErrorString, or one kept per
// thread until the next failure). Each dispatches to the compiled variant
// (indexer/launch.cu, indexer/bwd_launch.cu).
LaunchStatus run_indexer_fwd(const IndexerFwdParams& params, cudaStream_t stream, const char** detail);
// On entry d_index_k (float32 mode) or dk_fixed and bound_bits (deterministic
// mode) must be zero: the FFI handler clears them on the stream.
LaunchStatus run_indexer_bwd(const IndexerBwdParams& params, cudaStream_t stream, const char** detail);

// The deterministic backward of a call whose rows are sharded, split around
// its all-reduces (jax_attn_dist/ops/indexer/sharded_fixed_point.py): the
// rows' bound into bound_bits (zeroed by the caller); then, given every
// shard's bound, d_index_q, d_weights and this shard's fixed-point sums
// (dk_fixed and flag_bits zeroed by the caller) as limbs [3, 1, B * N * DI]
// and a flag [1] (fixed_point/limbs.h).
LaunchStatus run_indexer_bwd_bound(const IndexerBwdParams& params, cudaStream_t stream, const char** detail);
LaunchStatus run_indexer_bwd_fixed(const IndexerBwdParams& params, int32_t* limbs, int32_t* flags,
                                   cudaStream_t stream, const char** detail);

}  // namespace attn_dist
