// What every op's launcher and FFI handler share: the launch status and the
// layout of SPEC §6's per-row ranges. The ops' own parameters are in
// attn_dist/params.h and indexer/params.h.
#pragma once

namespace attn_dist {

// SPEC §6's per-row ranges, int32 [B, S, kRowRangeFields] per row: key_begin,
// key_end, topk_length (common/slot_validity.cuh applies them).
constexpr int kRowRangeFields = 3;

enum class LaunchStatus { kOk, kInvalidProblem, kUnsupportedDim, kTensorMapError, kLaunchError };

}  // namespace attn_dist
