// The sparse MLA backward's small kernels (csrc/sparse_mla/bwd_rows.cu) in a
// process of their own, for compute-sanitizer's racecheck, which fails inside
// the XLA process on that file's module (tools/gpu_check.sh sanitize-bwd says
// how). Each kernel's output is checked on the host.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -lineinfo -I csrc -isystem <cutlass>/include \
//     tests/support/bwd_rows_probe.cu csrc/sparse_mla/bwd_rows.cu -o /tmp/bwd_rows_probe
//   compute-sanitizer --tool racecheck --error-exitcode 9 /tmp/bwd_rows_probe
//
// The problem: B 2, S 8, H 65 (warps with 17 and 16 heads), D 576; the row
// terms with and without the bound, with heads whose lse is +inf, -inf or NaN
// (no terms: the warps leave the head loop at different heads before the
// barrier); max |kv| with a NaN in batch element 1; the column order and the
// fixed-point conversion, finite and not.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/fixed_point.cuh"
#include "sparse_mla/bwd_rows.h"

namespace {

using attn_dist::LaunchStatus;
using attn_dist::SparseMlaBwdParams;
namespace mla = attn_dist::sparse_mla;

constexpr int B = 2, S = 8, H = 65, D = 576, DV = 512, N = 48;
int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) ++failures, std::printf("FAILED: %s\n", what);
}

bool launched(LaunchStatus s, const char* detail, const char* name) {
  const cudaError_t e = cudaStreamSynchronize(nullptr);
  std::printf("%-22s launch %d, %s%s%s\n", name, int(s), cudaGetErrorString(e), detail ? " " : "", detail ? detail : "");
  expect(s == LaunchStatus::kOk && e == cudaSuccess, name);
  return s == LaunchStatus::kOk && e == cudaSuccess;
}

template <class T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  if (cudaMalloc(&d, h.size() * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <class T>
std::vector<T> host_copy(const T* d, size_t n) {
  std::vector<T> h(n);
  cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

std::vector<__nv_bfloat16> bf16_values(size_t n, uint32_t seed, std::vector<float>* as_float) {
  std::vector<__nv_bfloat16> h(n);
  as_float->resize(n);
  uint32_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    h[i] = __float2bfloat16(float(x >> 8) / float(1 << 24) - 0.5f);
    (*as_float)[i] = __bfloat162float(h[i]);
  }
  return h;
}

}  // namespace

int main() {
  std::vector<float> q_f, kv_f, out_f, dout_f;
  auto q_h = bf16_values(size_t(B) * S * H * D, 1, &q_f);
  auto kv_h = bf16_values(size_t(B) * N * D, 2, &kv_f);
  kv_h[size_t(N) * D + 7] = __float2bfloat16(NAN);  // batch element 1: max |kv| not finite
  auto out_h = bf16_values(size_t(B) * S * H * DV, 3, &out_f);
  auto dout_h = bf16_values(size_t(B) * S * H * DV, 4, &dout_f);
  std::vector<float> lse(size_t(B) * S * H), dlse(lse.size());
  for (size_t i = 0; i < lse.size(); ++i) {
    lse[i] = float(i % 7) - 3.f;
    dlse[i] = 0.01f * float(i % 5);
  }
  lse[3] = INFINITY, lse[H + 10] = -INFINITY, lse[2 * H + 64] = NAN;  // heads that take no probability

  SparseMlaBwdParams p = {};
  p.batch = B, p.s_q = S, p.s_kv = N, p.h_q = H, p.d_qk = D, p.d_v = DV, p.topk = 1;
  p.k_stride = 1, p.sm_scale = 0.0417f, p.scale_log2 = 0.0417f * 1.4426950408889634f, p.scale_rows = S;
  p.q = device_copy(q_h), p.kv = device_copy(kv_h), p.out = device_copy(out_h), p.dout = device_copy(dout_h);
  p.lse = device_copy(lse), p.dlse = device_copy(dlse);
  p.row_delta = device_copy(std::vector<float>(lse.size(), NAN));
  std::vector<float> dkv_in(size_t(B) * N * D);
  for (size_t i = 0; i < dkv_in.size(); ++i) dkv_in[i] = float(i);
  p.dkv = device_copy(dkv_in);
  std::vector<long long> fixed(size_t(B) * N * D);
  for (size_t i = 0; i < fixed.size(); ++i) fixed[i] = (long long)(i % 1000) - 500;
  p.dkv_fixed = device_copy(fixed);
  unsigned* words = device_copy(std::vector<unsigned>(2 * B, 0u));
  if (!p.q || !p.kv || !p.out || !p.dout || !p.lse || !p.dlse || !p.row_delta || !p.dkv || !p.dkv_fixed || !words) {
    std::printf("FAILED: cudaMalloc\n");
    return 1;
  }
  p.kv_max_bits = words, p.bound_bits = words + B, p.flag_bits = words + B;
  const char* detail = nullptr;

  // row_delta[head] = sum(out * dout) - dlse * log2(e) (lse and dlse in base 2 here).
  if (launched(mla::launch_row_terms(p, false, nullptr, &detail), detail, "row_terms<false>")) {
    const auto got = host_copy(p.row_delta, lse.size());
    for (size_t head = 0; head < lse.size(); ++head) {
      double dot = 0;
      for (int c = 0; c < DV; ++c) dot += double(out_f[head * DV + c]) * dout_f[head * DV + c];
      const double want = dot - double(dlse[head]) * 1.4426950408889634;
      if (!(std::fabs(got[head] - want) <= 1e-4 * (1 + std::fabs(want)))) {
        expect(false, "row_delta");
        break;
      }
    }
  }
  if (launched(mla::launch_kv_max(p, nullptr, &detail), detail, "kv_max")) {
    const auto bits = host_copy(words, B);
    float m0 = 0;
    for (int i = 0; i < N * D; ++i) m0 = std::fmax(m0, std::fabs(kv_f[i]));
    expect(std::memcmp(&m0, &bits[0], 4) == 0, "kv_max finite");
    expect(bits[1] == attn_dist::kNonFiniteBoundBits, "kv_max NaN flagged");
  }
  if (launched(mla::launch_row_terms(p, true, nullptr, &detail), detail, "row_terms<true>")) {
    const auto bits = host_copy(words + B, B);
    expect(bits[0] > 0 && bits[0] < attn_dist::kNonFiniteBoundBits, "bound finite for element 0");
    expect(bits[1] == attn_dist::kNonFiniteBoundBits, "bound not finite for element 1");
  }
  if (launched(mla::launch_dkv_fixed_to_float(p, nullptr, &detail), detail, "fixed_to_float")) {
    const auto got = host_copy(p.dkv, dkv_in.size());
    const auto bits = host_copy(words + B, B);
    // 2^-F with F = min(62 - e - ceil(log2(rows)), 126), bound < 2^e (common/fixed_point.cuh).
    float bound0;
    std::memcpy(&bound0, &bits[0], 4);
    int e = 0;
    std::frexp(bound0, &e);
    const int F = std::min(62 - e - attn_dist::ceil_log2(p.scale_rows), 126);
    const float from_fixed = std::ldexp(1.f, -F);
    bool ok0 = true, ok1 = true;
    for (size_t i = 0; i < size_t(N) * D; ++i) ok0 = ok0 && got[i] == float(fixed[i]) * from_fixed;
    for (size_t i = size_t(N) * D; i < got.size(); ++i) ok1 = ok1 && std::isnan(got[i]);
    expect(ok0, "fixed_to_float finite element");
    expect(ok1, "fixed_to_float NaN element");
  }
  std::vector<float> order(dkv_in.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = float(i);
  cudaMemcpy(p.dkv, order.data(), order.size() * 4, cudaMemcpyHostToDevice);
  if (launched(mla::launch_dkv_columns_in_order(p, nullptr, &detail), detail, "columns_in_order")) {
    // Column c of a 16-column group was stored at 4 ((c % 8) / 2) + 2 (c / 8) + c % 2.
    const auto got = host_copy(p.dkv, order.size());
    bool ok = true;
    for (size_t g = 0; g < order.size() / 16; ++g)
      for (int c = 0; c < 16; ++c) ok = ok && got[g * 16 + c] == float(g * 16 + 4 * ((c % 8) / 2) + 2 * (c / 8) + c % 2);
    expect(ok, "columns_in_order");
  }
  std::printf(failures ? "%d FAILED\n" : "all passed\n", failures);
  return failures ? 1 : 0;
}
