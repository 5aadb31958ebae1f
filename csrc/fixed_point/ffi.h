// The fixed-point limbs' XLA FFI target (fixed_point/ffi.cc): after the
// devices' limbs (common/fixed_point_limbs.cuh) have been added by an
// all-reduce, their float32 values. Shared by the ops whose deterministic
// backward sums over sharded rows.
#pragma once

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace attn_dist {

// (limbs int32 [3, G, M], flags int32 [G], bound_bits int32 [G]) -> out f32
// [G, M]; attr rows (int64): the row count the scale is chosen for.
inline constexpr const char* kLimbsToFloatTarget = "jax_attn_dist_fixed_point_limbs_to_float";
XLA_FFI_DECLARE_HANDLER_SYMBOL(kLimbsToFloat);

}  // namespace attn_dist
