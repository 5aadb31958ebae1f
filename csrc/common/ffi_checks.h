// What every op's XLA FFI handler uses to check its operands: errors that
// name the target, shape and alignment checks, SPEC §6's optional row ranges,
// and the launch status as an ffi::Error. Errors are returned, never aborts.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"

#include "params.h"
#include "variants.h"

namespace attn_dist {

namespace ffi = xla::ffi;

inline constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
// A row's slots (T, or indexer_topk's topk): the kernels count them in int32
// and step up to 128 past the last one, so a row holds at most 2^30
// (jax_attn_dist/_core/checks.py's MAX_SLOTS).
inline constexpr int64_t kMaxSlots = int64_t(1) << 30;

inline std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Errors name the FFI target they come from.
struct Checker {
  const char* target;

  ffi::Error Invalid(const std::string& msg) const {
    return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
  }

  ffi::Error Shape(const char* name, ffi::Span<const int64_t> got, std::initializer_list<int64_t> want,
                   const char* layout) const {
    bool ok = got.size() == want.size();
    for (size_t i = 0; ok && i < want.size(); ++i) ok = got[i] == want.begin()[i];
    if (ok) return ffi::Error::Success();
    std::string w = "[";
    size_t i = 0;
    for (int64_t d : want) w += (i++ ? ", " : "") + std::to_string(d);
    return Invalid(std::string(name) + " must have shape " + layout + " = " + w + "], got " +
                   attn_dist::Shape(got));
  }

  ffi::Error Launched(LaunchStatus status, const char* detail) const {
    switch (status) {
      case LaunchStatus::kOk: return ffi::Error::Success();
      case LaunchStatus::kInvalidProblem:
      case LaunchStatus::kUnsupportedDim: return Invalid(detail);
      case LaunchStatus::kTensorMapError: return ffi::Error::Internal(std::string(target) + ": " + detail);
      case LaunchStatus::kLaunchError:
        return ffi::Error::Internal(std::string(target) + ": kernel launch failed: " + detail);
    }
    return ffi::Error::Internal(std::string(target) + ": unknown launch status");
  }
};

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether v is one of a compiled-variant field's values (common/variants.h).
template <size_t N>
bool OneOf(int64_t v, const IntSet<N>& set) {
  return set.contains(v);
}

// SPEC §6's per-row ranges (common/slot_validity.cuh): an optional operand
// (absent in calls exported before it existed), int32 [B, S, 3], or
// [B, S, 0] for none; without ranges the kernels apply SPEC §2's rule. Their
// values need no check: the kernels clamp them.
using OptionalRanges = std::optional<ffi::Buffer<ffi::S32>>;

inline ffi::Error CheckRowRanges(const Checker& check, const OptionalRanges& row_ranges, int64_t B, int64_t S,
                                 const int32_t** ranges) {
  *ranges = nullptr;
  if (!row_ranges.has_value()) return ffi::Error::Success();
  const auto rd = row_ranges->dimensions();
  const bool given = rd.size() == 3 && rd[2] == kRowRangeFields;
  if (rd.size() != 3 || rd[0] != B || rd[1] != S || (rd[2] != kRowRangeFields && rd[2] != 0))
    return check.Invalid("row_ranges must have shape [B, S, 3] = [" + std::to_string(B) + ", " + std::to_string(S) +
                         ", 3], or [B, S, 0] for none, got " + Shape(rd));
  if (given) *ranges = row_ranges->typed_data();
  return ffi::Error::Success();
}

// The sizes every kernel counts in int32: S, N and the grid's rows (what
// `rows` says they are) below 2^31, a row's slots T at most kMaxSlots.
inline ffi::Error CheckProblemSize(const Checker& check, int64_t S, int64_t N, int64_t T, int64_t rows,
                                   const char* rows_what) {
  if (S <= kIntMax && N <= kIntMax && T <= kMaxSlots && rows <= kIntMax) return ffi::Error::Success();
  return check.Invalid(std::string("problem too large: S, N and ") + rows_what +
                       " must be < 2^31 and T at most 2^30, got S = " + std::to_string(S) + ", N = " +
                       std::to_string(N) + ", T = " + std::to_string(T) + ", " + rows_what + " = " +
                       std::to_string(rows));
}

}  // namespace attn_dist
