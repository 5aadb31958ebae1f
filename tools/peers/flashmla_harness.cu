// A C entry point to FlashMLA's SM90 sparse prefill forward, for timing it
// beside sparse_mla without torch. Built by flashmla_sparse_prefill.sh against
// a FlashMLA checkout that stays outside this repository.
//
// The params are filled as FlashMLA's own sparse_attn_prefill_interface
// (csrc/api/sparse_fwd.h) fills them for contiguous tensors:
//   q       [s_q, h_q, d_qk]   bf16
//   kv      [s_kv, 1, d_qk]    bf16 (h_kv = 1)
//   indices [s_q, 1, topk]     int32; -1 or >= s_kv is an invalid slot
//   out     [s_q, h_q, d_v]    bf16
//   max_logits, lse [s_q, h_q] float32, natural-log base (+inf lse for a row
//                              without a valid slot)
// No attention sink, no topk_length. The int-returning calls return 0, or a
// nonzero code after printing the reason to stderr.

#include <cstdio>
#include <exception>

#include <cuda_runtime.h>

#include "params.h"
#include "sm90/prefill/sparse/phase1.h"

namespace {

constexpr float LOG_2_E = 1.44269504f;  // as in FlashMLA's csrc/api/common.h

int check(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 0;
    fprintf(stderr, "flashmla_harness: %s: %s\n", what, cudaGetErrorString(e));
    return 1;
}

// FlashMLA's shape checks (sparse_fwd.h, and the SM90 kernel's own asserts).
int check_shapes(int h_q, int d_qk, int d_v, int topk) {
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    const char *bad = major != 9 || minor != 0 ? "the kernel needs an SM90 GPU"
                    : h_q != 64 && h_q != 128  ? "h_q must be 64 or 128"
                    : d_qk != 576 && d_qk != 512 ? "d_qk must be 576 or 512"
                    : d_v != 512                 ? "d_v must be 512"
                    : topk <= 0 || topk % 128 != 0 ? "topk must be a positive multiple of 128"
                    : nullptr;
    if (bad) fprintf(stderr, "flashmla_harness: %s\n", bad);
    return bad ? 2 : 0;
}

SparseAttnFwdParams make_params(const void *q, const void *kv, const int *indices, void *out, float *max_logits,
                                float *lse, int s_q, int s_kv, int h_q, int d_qk, int d_v, int topk, float sm_scale,
                                cudaStream_t stream) {
    using bf16 = cutlass::bfloat16_t;
    const int h_kv = 1;
    int dev = 0, num_sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev);
    return SparseAttnFwdParams{
        s_q, s_kv, h_q, h_kv, d_qk, d_v, topk,
        sm_scale, sm_scale * LOG_2_E,
        (bf16 *)q, (bf16 *)kv, (int *)indices,
        nullptr,  // attn_sink
        nullptr,  // topk_length
        h_q * d_qk, d_qk,   // q strides: s_q, h_q
        h_kv * d_qk, d_qk,  // kv strides: s_kv, h_kv
        h_kv * topk, topk,  // indices strides: s_q, h_kv
        (bf16 *)out, max_logits, lse,
        num_sms, stream,
    };
}

// Fwd_Sm90_Impl's dispatch, without topk_length.
int launch(const SparseAttnFwdParams &p) {
    try {
        if (p.d_qk == 576) sm90::fwd::run_fwd_phase1_kernel<576, false>(p);
        else sm90::fwd::run_fwd_phase1_kernel<512, false>(p);
    } catch (const std::exception &e) {
        fprintf(stderr, "flashmla_harness: %s\n", e.what());
        return 3;
    }
    return 0;
}

}  // namespace

extern "C" {

// One forward on `stream` (0: the legacy default stream), then a synchronisation
// of the stream, so that the outputs are ready when it returns.
int flashmla_sparse_fwd(const void *q, const void *kv, const int *indices, void *out, float *max_logits, float *lse,
                        int s_q, int s_kv, int h_q, int d_qk, int d_v, int topk, float sm_scale, void *stream) {
    if (int e = check_shapes(h_q, d_qk, d_v, topk)) return e;
    auto s = (cudaStream_t)stream;
    if (int e = launch(make_params(q, kv, indices, out, max_logits, lse, s_q, s_kv, h_q, d_qk, d_v, topk, sm_scale, s)))
        return e;
    return check(cudaStreamSynchronize(s), "forward");
}

// `warmup` forwards, then `iters` forwards between two cudaEvents on `stream`;
// *mean_ms = the events' elapsed time / iters. Synchronises before returning.
int flashmla_sparse_fwd_time(const void *q, const void *kv, const int *indices, void *out, float *max_logits,
                             float *lse, int s_q, int s_kv, int h_q, int d_qk, int d_v, int topk, float sm_scale,
                             void *stream, int warmup, int iters, float *mean_ms) {
    if (int e = check_shapes(h_q, d_qk, d_v, topk)) return e;
    if (iters <= 0) return 2;
    auto s = (cudaStream_t)stream;
    const SparseAttnFwdParams p = make_params(q, kv, indices, out, max_logits, lse, s_q, s_kv, h_q, d_qk, d_v, topk,
                                              sm_scale, s);
    for (int i = 0; i < warmup; ++i)
        if (int e = launch(p)) return e;
    cudaEvent_t start, stop;
    if (check(cudaEventCreate(&start), "event") || check(cudaEventCreate(&stop), "event")) return 1;
    int err = check(cudaEventRecord(start, s), "event record");
    for (int i = 0; i < iters && !err; ++i) err = launch(p);
    if (!err) err = check(cudaEventRecord(stop, s), "event record");
    if (!err) err = check(cudaEventSynchronize(stop), "timed forwards");
    float ms = 0.f;
    if (!err) err = check(cudaEventElapsedTime(&ms, start, stop), "elapsed time");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    *mean_ms = ms / iters;
    return err;
}

// Device buffers for the outputs, owned by the caller through these (the inputs
// are JAX arrays; the outputs are kept out of JAX's buffers).
void *flashmla_malloc(size_t bytes) {
    void *p = nullptr;
    return check(cudaMalloc(&p, bytes), "cudaMalloc") ? nullptr : p;
}

int flashmla_free(void *p) { return check(cudaFree(p), "cudaFree"); }

int flashmla_to_host(void *dst, const void *src, size_t bytes) {
    return check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
}

int flashmla_synchronize() { return check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

}  // extern "C"
