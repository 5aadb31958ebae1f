// The Python extension: XLA FFI handler capsules for jax.ffi.register_ffi_target,
// the build identity, and the compiled kernel variants (from the ops'
// variants.py; a test checks them against the Python lists).
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include "attn_dist/ffi.h"
#include "attn_dist/variants.h"
#include "fixed_point/ffi.h"
#include "indexer/ffi.h"
#include "indexer/variants.h"
#include "indexer_topk/ffi.h"
#include "indexer_topk/variants.h"
#include "sparse_mla/ffi.h"
#include "sparse_mla/variants.h"
#if JAX_ATTN_DIST_TEST_TARGETS
#include "testing/ffi.h"
#endif

#ifndef JAX_ATTN_DIST_BUILD_ID
#error "CMakeLists.txt defines JAX_ATTN_DIST_BUILD_ID (the hash of the kernel sources, see there)"
#endif
#ifndef JAX_ATTN_DIST_TEST_TARGETS
#error "CMakeLists.txt defines JAX_ATTN_DIST_TEST_TARGETS (0 or 1)"
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

template <size_t N>
nb::tuple Ints(const attn_dist::IntSet<N>& set) {
  nb::list l;
  for (int v : set) l.append(v);
  return nb::tuple(l);
}

}  // namespace

NB_MODULE(_cuda, m) {
  using namespace attn_dist;
  m.doc() = "jax_attn_dist CUDA (sm_90a) kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d[kAttnDistFwdTarget] = Capsule(kAttnDistFwd);
    d[kIndexerFwdTarget] = Capsule(kIndexerFwd);
    d[kIndexerBwdTarget] = Capsule(kIndexerBwd);
    d[kIndexerBwdBoundTarget] = Capsule(kIndexerBwdBound);
    d[kIndexerBwdFixedTarget] = Capsule(kIndexerBwdFixed);
    d[kIndexerTopkTarget] = Capsule(kIndexerTopk);
    d[kSparseMlaFwdTarget] = Capsule(kSparseMlaFwd);
    d[kSparseMlaBwdTarget] = Capsule(kSparseMlaBwd);
    d[kSparseMlaBwdBoundTarget] = Capsule(kSparseMlaBwdBound);
    d[kSparseMlaBwdFixedTarget] = Capsule(kSparseMlaBwdFixed);
    d[kLimbsToFloatTarget] = Capsule(kLimbsToFloat);
#if JAX_ATTN_DIST_TEST_TARGETS
    d[kAttnDistFwdIntoTarget] = Capsule(kAttnDistFwdInto);
    d[kIndexerFwdIntoTarget] = Capsule(kIndexerFwdInto);
    d[kIndexerBwdIntoTarget] = Capsule(kIndexerBwdInto);
    d[kSparseMlaFwdIntoTarget] = Capsule(kSparseMlaFwdInto);
    d[kSparseMlaBwdIntoTarget] = Capsule(kSparseMlaBwdInto);
#endif
    return d;
  });
  m.def("test_targets_built", []() { return bool(JAX_ATTN_DIST_TEST_TARGETS); },
        "Whether registrations() includes the test-only poisoned *_into targets "
        "(CMake option JAX_ATTN_DIST_TEST_TARGETS)");
  m.def("build_id", []() { return JAX_ATTN_DIST_BUILD_ID; },
        "SHA-256 of the kernel sources at build time (see CMakeLists.txt and jax_attn_dist's build_id_of)");
  m.def(
      "kernel_variants",
      []() {
        nb::dict d;
        nb::list attn, fwd, bwd, sparse_mla;
        for (const AttnDistVariant& v : kAttnDistVariants) attn.append(nb::make_tuple(v.d, v.head_tile));
        for (const IndexerFwdVariant& v : kIndexerFwdVariants)
          fwd.append(nb::make_tuple(v.di, v.head_tile, v.head_tiles));
        for (const IndexerBwdVariant& v : kIndexerBwdVariants)
          bwd.append(nb::make_tuple(v.di, v.head_tile, v.deterministic));
        for (const SparseMlaVariant& v : kSparseMlaVariants) sparse_mla.append(nb::make_tuple(v.d, v.head_tile));
        d["attn_dist"] = attn;
        d["indexer_fwd"] = fwd;
        nb::list topk;
        for (const IndexerTopkVariant& v : kIndexerTopkVariants) topk.append(nb::make_tuple(v.di, v.hi));
        d["indexer_bwd"] = bwd;
        d["indexer_topk"] = topk;
        d["sparse_mla"] = sparse_mla;
        return d;
      },
      "The compiled kernel variants, in the order of the ops' variants.py lists");
  m.def("attn_dist_head_dims", []() { return Ints(kAttnDistHeadDims); });
  m.def("sparse_mla_head_dims", []() { return Ints(kSparseMlaHeadDims); });
  m.def("indexer_head_dims", []() { return Ints(kIndexerFwdHeadDims); });
  m.def("indexer_max_heads", []() { return IndexerFwdMaxHeads(); });
  m.def("indexer_bwd_max_heads", []() { return IndexerBwdMaxHeads(); });
}
