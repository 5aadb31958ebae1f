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
// terms in both lse bases and with the bound, row 0 (the largest bound, its q
// scaled up) holding heads whose lse is +inf, -inf or NaN (no terms: the warps
// leave the head loop at different heads before the barrier); max |kv| with
// a NaN in batch element 1; the column order and the fixed-point conversion,
// finite and not.
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
  for (size_t i = 0; i < size_t(H) * D; ++i) {  // row 0: the batch element's largest bound
    q_f[i] *= 8.f;
    q_h[i] = __float2bfloat16(q_f[i]);
  }
  auto kv_h = bf16_values(size_t(B) * N * D, 2, &kv_f);
  kv_h[size_t(N) * D + 7] = __float2bfloat16(NAN);  // batch element 1: max |kv| not finite
  auto out_h = bf16_values(size_t(B) * S * H * DV, 3, &out_f);
  auto dout_h = bf16_values(size_t(B) * S * H * DV, 4, &dout_f);
  std::vector<float> lse(size_t(B) * S * H), dlse(lse.size());
  for (size_t i = 0; i < lse.size(); ++i) {
    lse[i] = float(i % 7) - 3.f;
    dlse[i] = 0.01f * float(i % 5);
  }
  lse[3] = INFINITY, lse[10] = -INFINITY, lse[64] = NAN;  // heads of row 0 that take no probability

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

  // row_delta[head] = sum(out * dout) - dlse in base e (dlse * log2(e) where lse is in base 2).
  std::vector<double> delta(lse.size());
  for (int base_e = 1; base_e >= 0; --base_e) {  // base 2 last: the bound below uses its delta
    p.lse_base_e = base_e;
    if (!launched(mla::launch_row_terms(p, false, nullptr, &detail), detail, "row_terms<false>")) continue;
    const auto got = host_copy(p.row_delta, lse.size());
    bool ok = true;
    for (size_t head = 0; head < lse.size(); ++head) {
      double dot = 0;
      for (int c = 0; c < DV; ++c) dot += double(out_f[head * DV + c]) * dout_f[head * DV + c];
      delta[head] = dot - double(dlse[head]) * (base_e ? 1.0 : 1.4426950408889634);
      ok = ok && std::fabs(got[head] - delta[head]) <= 1e-4 * (1 + std::fabs(delta[head]));
    }
    expect(ok, base_e ? "row_delta, lse in base e" : "row_delta, lse in base 2");
  }

  if (launched(mla::launch_kv_max(p, nullptr, &detail), detail, "kv_max")) {
    const auto bits = host_copy(words, B);
    float m0 = 0;
    for (int i = 0; i < N * D; ++i) m0 = std::fmax(m0, std::fabs(kv_f[i]));
    expect(std::memcmp(&m0, &bits[0], 4) == 0, "kv_max finite");
    expect(bits[1] == attn_dist::kNonFiniteBoundBits, "kv_max NaN flagged");
  }
  if (launched(mla::launch_row_terms(p, true, nullptr, &detail), detail, "row_terms<true>")) {
    // Element 0's bound (bwd_rows.cu): the max over its rows of
    // 4 (kv_max sum_h qmax_h l1_h + sum_h (qmax_h |delta_h| + max|dout_h|)),
    // qmax_h = sm_scale max|q_h|, over the heads with a finite lse.
    const auto bits = host_copy(words, 2 * B);  // kv_max_bits, then bound_bits
    float kv_max;
    std::memcpy(&kv_max, &bits[0], 4);
    double want = 0;
    for (int row = 0; row < S; ++row) {
      double a = 0, b = 0;
      for (int h = 0; h < H; ++h) {
        const size_t head = size_t(row) * H + h;
        if (!std::isfinite(lse[head])) continue;
        double q_max = 0, l1 = 0, dout_max = 0;
        for (int c = 0; c < D; ++c) q_max = std::fmax(q_max, std::fabs(q_f[head * D + c]));
        for (int c = 0; c < DV; ++c) {
          l1 += std::fabs(dout_f[head * DV + c]);
          dout_max = std::fmax(dout_max, std::fabs(dout_f[head * DV + c]));
        }
        q_max *= double(p.sm_scale);
        a += q_max * l1;
        b += q_max * std::fabs(delta[head]) + dout_max;
      }
      want = std::fmax(want, 4.0 * (a * kv_max + b));
    }
    float got;
    std::memcpy(&got, &bits[B], 4);
    expect(std::fabs(got - want) <= 1e-5 * want, "bound of element 0");
    expect(bits[B + 1] == attn_dist::kNonFiniteBoundBits, "bound not finite for element 1");
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
