// Plain data handed from the indexer_topk FFI handler to its launcher.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace attn_dist {

// indexer_topk's operands, canonical batched, row-major:
//   index_q [B, S, HI, DI] and index_k [B, N, DI], both bf16 or both float8
//   e4m3 (`float8_inputs`), weights [B, S, HI] f32,
//   index_k_scale [B, N] f32, q_start [B] int32, optional row_ranges [B, S, 3]
//   int32 (only fields 0 and 1, the key range, are read)
//   -> indices [B, S, 1, topk] int32.
// For each row, logit(n) = scale * sum_h weights[h] * relu((index_q[h] . index_k[n]) * index_k_scale[n])
// over the row's valid keys (common/slot_validity.cuh, make_key_range); the
// output is the topk largest, ties to the smaller key, in ascending key order,
// then -1.
struct IndexerTopkParams {
  int batch, s_q, s_kv, h_idx, d_idx, topk;

  bool causal;
  int k_stride;
  float scale;

  bool float8_inputs;      // index_q and index_k are float8 e4m3, else bf16
  const void* index_q;
  const void* index_k;
  const float* weights;
  const float* index_k_scale;
  const int32_t* q_start;
  const int32_t* row_ranges;  // [B, S, 3] or nullptr

  int32_t* indices;        // [B, S, 1, topk]
};

// Launch on `stream`; never synchronise, never allocate. On failure `detail`
// says why (indexer_topk/launch.cu dispatches to the compiled variant).
LaunchStatus run_indexer_topk(const IndexerTopkParams& params, cudaStream_t stream, const char** detail);

}  // namespace attn_dist
