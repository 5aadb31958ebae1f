// The Python extension: XLA FFI handler capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "ffi.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "jax_attn_dist CUDA (sm_90a) kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_attn_dist_fwd"] = Capsule(attn_dist::kAttnDistFwd);
    d["jax_attn_dist_fwd_into"] = Capsule(attn_dist::kAttnDistFwdInto);
    return d;
  });
}
