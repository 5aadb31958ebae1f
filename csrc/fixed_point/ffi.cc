// The fixed-point limbs' FFI handler: re-validates the shapes, then launches
// the conversion (limbs.h). No synchronisation, no allocation.
#include "ffi.h"

#include "../common/ffi_checks.h"
#include "../common/fixed_point_limbs.cuh"
#include "limbs.h"

namespace attn_dist {

namespace {

ffi::Error LimbsToFloatImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> limbs, ffi::Buffer<ffi::S32> flags,
                            ffi::Buffer<ffi::S32> bound_bits, ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t rows) {
  const Checker check{kLimbsToFloatTarget};
  const auto ld = limbs.dimensions();
  if (ld.size() != 3 || ld[0] != 3) return check.Invalid("limbs must be rank 3 [3, G, M], got " + Shape(ld));
  const int64_t G = ld[1], M = ld[2];
  if (auto e = check.Shape("flags", flags.dimensions(), {G}, "[G]"); e.failure()) return e;
  if (auto e = check.Shape("bound_bits", bound_bits.dimensions(), {G}, "[G]"); e.failure()) return e;
  if (auto e = check.Shape("out", out->dimensions(), {G, M}, "[G, M]"); e.failure()) return e;
  if (rows < 1 || rows > kMaxScaleRows)
    return check.Invalid("rows must be in [1, 2^40], got " + std::to_string(rows));
  if (G > kIntMax) return check.Invalid("G must be at most 2^31 - 1, got " + std::to_string(G));
  const char* detail = "";
  return check.Launched(launch_limbs_to_float(limbs.typed_data(), flags.typed_data(), bound_bits.typed_data(), int(G),
                                              M, rows, out->typed_data(), stream, &detail),
                        detail);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLimbsToFloat, LimbsToFloatImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // limbs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // flags
                                  .Arg<ffi::Buffer<ffi::S32>>()  // bound_bits
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("rows"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace attn_dist
