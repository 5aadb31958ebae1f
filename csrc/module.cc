// The Python extension: XLA FFI handler capsules for jax.ffi.register_ffi_target,
// the build identity, and the kernels' coverage constants (checked against
// jax_attn_dist/_contract.py by the tests).
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include "ffi.h"

#ifndef JAX_ATTN_DIST_BUILD_ID
#error "CMakeLists.txt defines JAX_ATTN_DIST_BUILD_ID (the hash of csrc/ and CMakeLists.txt)"
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

template <size_t N>
nb::tuple Ints(const int (&values)[N]) {
  nb::list l;
  for (int v : values) l.append(v);
  return nb::tuple(l);
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "jax_attn_dist CUDA (sm_90a) kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d[attn_dist::kAttnDistTarget] = Capsule(attn_dist::kAttnDistFwd);
    d[attn_dist::kAttnDistPoisonedTarget] = Capsule(attn_dist::kAttnDistFwdInto);
    d[attn_dist::kIndexerFwdTarget] = Capsule(attn_dist::kIndexerFwd);
    d[attn_dist::kIndexerFwdPoisonedTarget] = Capsule(attn_dist::kIndexerFwdInto);
    d[attn_dist::kIndexerBwdTarget] = Capsule(attn_dist::kIndexerBwd);
    d[attn_dist::kIndexerBwdPoisonedTarget] = Capsule(attn_dist::kIndexerBwdInto);
    return d;
  });
  m.def("build_id", []() { return JAX_ATTN_DIST_BUILD_ID; },
        "SHA-256 of csrc/ and CMakeLists.txt at build time (see jax_attn_dist._ext.build_id_of)");
  m.def("attn_dist_head_dims", []() { return Ints(attn_dist::kAttnDistHeadDims); });
  m.def("indexer_head_dims", []() { return Ints(attn_dist::kIndexerHeadDims); });
  m.def("indexer_max_heads", []() { return attn_dist::kIndexerMaxHeads; });
  m.def("indexer_bwd_max_heads", []() { return attn_dist::kIndexerBwdMaxHeads; });
}
