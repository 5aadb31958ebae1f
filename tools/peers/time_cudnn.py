"""cuDNN-frontend's SM90 DeepSeek-Sparse-Attention kernels, timed as peers.

Timing only: the script imports NVIDIA's ``cudnn`` package (nvidia-cudnn-
frontend 1.32, CuTe DSL kernels that JIT-compile on their first call) and
calls its public entry points; no cuDNN code lives in this repository.

What runs on an SM90 (H100) device, at the v32 shapes:

* ``idx``: the indexer in two passes, as cuDNN does it on Hopper:
  ``cudnn.deepseek_sparse_attention.indexer_forward_wrapper`` (the SM90 route
  is ``indexer_forward/_interface_sm90.indexer_fwd``: ``out.fill_(-inf)`` then
  the IndexerForwardSm90 kernel writing dense float32 scores [1, S, N]) and
  the radix top-k ``IndexerTopK`` (class API, caller-owned outputs and
  workspace) over those scores. index_q [1, S, HI, DI] bf16, index_k
  [1, N, 1, DI] bf16, weights [1, S, HI] float32, ratio=1, sm_scale=1,
  q_causal_offsets=[N - S] (query s sees keys n <= s + N - S, our
  q_start_index = N - S convention); top-k over each row's first
  s + N - S + 1 columns (seq_lens, next_n=1), indices only (return_val=False).
  Timed: the logits pass, the top-k pass and both back to back.
* ``idx-fp8``: the same with ``precision="fp8"`` (Hopper 1x128 descale path):
  float8_e4m3fn index_q/index_k, float32 per-(row, head) q_scale and per-key
  k_scale, float32 weights pre-multiplied by q_scale (the kernel then skips
  q_scale), then the same top-k.
* ``bwd-h128`` / ``bwd-h64``: ``SparseAttentionBackward`` (class API of
  ``sparse_attention_backward_wrapper``; SM90 route
  ``sparse_attention_backward/_interface_sm90.flash_attn_bwd_sm90``: memset
  of the fp32 dKV accumulator, preprocess, main kernel with atomic dKV
  scatter, postprocess). q [S, H, 576] bf16, kv [N, 576] bf16 (one latent
  head, V = its first 512 columns), out/dout [S, H, 512] bf16, lse [S, H]
  float32 natural-log, attn_sink [H] = -inf (no sink), indices [S, T] int32
  of T distinct random causal-visible keys per row, softmax_scale 576**-0.5.
  cuDNN has no SM90 sparse forward, so out/lse come from a float32 torch
  reference (chunked). Outputs dq [S, H, 576], dkv [N, 576] (bf16), d_sink [H].
  Checked: determinism (two runs compared bitwise) and dq/dkv against a
  float32 torch backward.
* ``fwd-probe``: ``SparseAttentionForward.check_support`` is called to record
  that cuDNN's DSA sparse forward is SM100-only (nothing is timed).
* ``ours`` (``--ours``): jax_attn_dist.indexer_topk, sparse_mla forward and
  its backward (jax.vjp, as benchmarks/sparse_mla_bench.py: fwd+bwd minus
  fwd) at the same shapes, timed as benchmarks/bench.py times them.
* ``graphs``: the cuDNN calls again, captured in a CUDA graph of ``--iters``
  calls, so host launch overhead is out of the figure (last, as it is the
  riskiest step).

Timing of cuDNN calls: ``--warmup`` calls, then ``--rounds`` rounds of
``--iters`` back-to-back calls between two CUDA events; the median round's
ms per call is reported (plus every round, and the host's enqueue time per
call, to show whether a figure is launch-bound).

Every step runs under try/except (traceback printed and stored); the JSON is
rewritten after every step. Install and run on the device:

    pip install --no-deps --no-index --target /tmp/cudnn_site /path/to/wheels/*.whl
    PYTHONPATH=/tmp/cudnn_site python3 tools/peers/time_cudnn.py --ours

(``--cudnn-site`` / ``$CUDNN_SITE`` name the folder too: the CuTe DSL wheel
puts its ``cutlass`` package on sys.path through a .pth file, which
PYTHONPATH alone does not run; this script runs it with site.addsitedir.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T_START = time.time()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T_START:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------
# results, always written
# ----------------------------------------------------------------------------

RES: dict = {"meta": {}, "shapes": {}, "cudnn": {}, "ours": {}, "errors": {}, "notes": {}}
OUT_PATH = None


def save() -> None:
    if not OUT_PATH:
        return
    try:
        d = os.path.dirname(os.path.abspath(OUT_PATH))
        os.makedirs(d, exist_ok=True)
        tmp = OUT_PATH + ".tmp"
        with open(tmp, "w") as f:
            json.dump(RES, f, indent=1, default=str)
        os.replace(tmp, OUT_PATH)
    except Exception:  # noqa: BLE001 - never let the writer kill the run
        traceback.print_exc()


def run_step(name: str, fn, *a, **kw):
    log(f"=== {name}: start")
    t0 = time.time()
    try:
        r = fn(*a, **kw)
        log(f"=== {name}: done in {time.time() - t0:.1f}s")
        return r
    except BaseException as e:  # noqa: BLE001 - keep going whatever happens (KeyboardInterrupt re-raised)
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        RES["errors"][name] = tb
        log(f"=== {name}: FAILED after {time.time() - t0:.1f}s: {type(e).__name__}: {e}")
        if isinstance(e, KeyboardInterrupt):
            save()
            raise
        return None
    finally:
        save()


# ----------------------------------------------------------------------------
# the cuDNN wheels' folder
# ----------------------------------------------------------------------------


def setup_cudnn_site(extra):
    """Put the --target folder(s) of the cuDNN wheels first on sys.path and run
    their .pth files (nvidia_cutlass_dsl_packages.pth adds the folder that
    holds the ``cutlass`` package)."""
    import site

    cands = [extra, os.environ.get("CUDNN_SITE"), "/tmp/cudnn_site"]
    cands += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    used = []
    for d in cands:
        if not d or not os.path.isdir(d) or d in used:
            continue
        if not (os.path.isdir(os.path.join(d, "cudnn")) or os.path.isdir(os.path.join(d, "nvidia_cutlass_dsl"))):
            continue
        if d not in sys.path:
            sys.path.insert(0, d)
        try:
            site.addsitedir(d)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        used.append(d)
    # fallback: the .pth's own effect, by hand
    for d in used:
        p = os.path.join(d, "nvidia_cutlass_dsl", "dsl_packages")
        if os.path.isdir(p) and p not in sys.path:
            sys.path.insert(0, p)
    return used


# ----------------------------------------------------------------------------
# timing helpers
# ----------------------------------------------------------------------------


def time_cuda(fn, *, warmup, rounds, iters):
    """{'ms': median per-call ms over rounds, 'rounds_ms', 'host_enqueue_ms'}."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per, host = [], []
    for _ in range(rounds):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        h0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host.append((time.perf_counter() - h0) / iters * 1e3)
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / iters)
    ms = statistics.median(per)
    hm = statistics.median(host)
    return {"ms": ms, "rounds_ms": per, "host_enqueue_ms": hm, "launch_bound_suspect": hm > 0.8 * ms}


def time_graph(fn, *, warmup, rounds, iters):
    """The same calls captured once in a CUDA graph of ``iters`` calls."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    for _ in range(max(1, warmup)):
        g.replay()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / iters)
    del g
    return {"ms": statistics.median(per), "rounds_ms": per}


def timed_first_call(what, fn):
    import torch

    log(f"{what}: first call (JIT compile) ...")
    t0 = time.time()
    r = fn()
    torch.cuda.synchronize()
    dt = time.time() - t0
    log(f"{what}: first call done in {dt:.1f}s")
    return r, dt


def fmt(t):
    s = f"{t['ms']:.4f} ms/call (rounds {', '.join(f'{x:.4f}' for x in t['rounds_ms'])}"
    if "host_enqueue_ms" in t:
        s += f"; host enqueue {t['host_enqueue_ms']:.4f} ms/call"
        if t.get("launch_bound_suspect"):
            s += " LAUNCH-BOUND?"
    return s + ")"


# graph timings to run at the end: name -> the call (its closure keeps its tensors alive)
GRAPH_JOBS: dict = {}


# ----------------------------------------------------------------------------
# The indexer forward + top-k
# ----------------------------------------------------------------------------


def step_indexer(args, fp8: bool):
    import torch
    from cudnn.deepseek_sparse_attention import IndexerTopK, indexer_forward_wrapper

    dev = torch.device("cuda")
    S, N, HI, DI, K = args.S, args.N, args.HI, args.DI, args.topk
    q0 = N - S
    key = "indexer_fp8" if fp8 else "indexer_bf16"
    r = RES["cudnn"][key] = {
        "shape": {"S": S, "N": N, "HI": HI, "DI": DI, "topk": K, "q_start_index": q0, "causal": True},
        "calls": {
            "logits": ("cudnn.deepseek_sparse_attention.indexer_forward_wrapper(q[1,S,HI,DI], k[1,N,1,DI], "
                       "w[1,S,HI] f32, ratio=1, qhead_per_kv_head=HI, sm_scale=1.0, out=<[1,S,N] f32>, "
                       f"q_causal_offsets=int32[{q0}], precision={'fp8' if fp8 else 'bf16'!r}"
                       + (", q_scale=f32[1,S,HI], k_scale=f32[1,N,1]" if fp8 else "") + ") "
                       "-> SM90 indexer_forward/_interface_sm90.indexer_fwd (out.fill_(-inf) + IndexerForwardSm90)"),
            "topk": ("cudnn.deepseek_sparse_attention.IndexerTopK(sample_input_values=<[S,N] f32 logits>, "
                     f"sample_seq_lens=int32[S] (s+{q0}+1), top_k={K}, next_n=1, return_val=False).execute("
                     "logits, seq_lens, out_indices=int32[S,K], workspace=uint8[scratch_workspace_bytes()])"),
        },
    }
    g = torch.Generator(device=dev)
    g.manual_seed(1234)
    qf = torch.randn(1, S, HI, DI, generator=g, device=dev) * DI ** -0.25
    kf = torch.randn(1, N, 1, DI, generator=g, device=dev) * DI ** -0.25
    w = torch.randn(1, S, HI, generator=g, device=dev) * HI ** -0.5
    offs = torch.tensor([q0], dtype=torch.int32, device=dev)
    logits = torch.empty(1, S, N, dtype=torch.float32, device=dev)
    if fp8:
        fmax = float(torch.finfo(torch.float8_e4m3fn).max)
        q_scale = (qf.abs().amax(-1) / fmax).contiguous()          # [1, S, HI]
        k_scale = (kf.abs().amax(-1) / fmax).contiguous()          # [1, N, 1]
        iq = (qf / q_scale[..., None]).to(torch.float8_e4m3fn).contiguous()
        ik = (kf / k_scale[..., None]).to(torch.float8_e4m3fn).contiguous()
        wq = (w * q_scale).contiguous()                            # pre-scaled float32 weights
        extra = dict(precision="fp8", q_scale=q_scale, k_scale=k_scale)
    else:
        iq = qf.to(torch.bfloat16).contiguous()
        ik = kf.to(torch.bfloat16).contiguous()
        wq = w.contiguous()
        extra = {}
    del qf, kf

    def run_logits():
        return indexer_forward_wrapper(iq, ik, wq, ratio=1, qhead_per_kv_head=HI, sm_scale=1.0, out=logits,
                                       q_causal_offsets=offs, **extra)

    res, r["logits_compile_s"] = timed_first_call(f"{key} logits", run_logits)
    assert res["scores"].data_ptr() == logits.data_ptr(), "cuDNN did not write into the given out"

    # -- check: a few rows against torch
    try:
        rows = sorted({0, 1, S // 2, S - 2, S - 1})
        kk = ik[0, :, 0].float()
        errs, mask_ok = [], True
        for s in rows:
            L = min(s + q0 + 1, N)
            prod = torch.relu(iq[0, s].float() @ kk.T)                                 # [HI, N]
            ref = (wq[0, s][:, None] * prod).sum(0)
            if fp8:
                ref = ref * k_scale[0, :, 0]
            got = logits[0, s]
            scale_ = ref[:L].abs().max().clamp_min(1e-30)
            errs.append(float(((got[:L] - ref[:L]).abs().max() / scale_).item()))
            if L < N:
                mask_ok &= bool(torch.isneginf(got[L:]).all().item())
        r["check_logits"] = {"rows": rows, "max_abs_err_rel_to_row_max": errs, "masked_cols_are_-inf": mask_ok}
        log(f"{key} logits check: rel err per row {['%.2e' % e for e in errs]}, masked -inf: {mask_ok}")
    except Exception:  # noqa: BLE001
        r["check_logits_error"] = traceback.format_exc()
        traceback.print_exc()

    t = time_cuda(run_logits, warmup=args.warmup, rounds=args.rounds, iters=args.iters)
    r["logits"] = t
    log(f"{key} logits (indexer_forward_wrapper, incl. its out.fill_(-inf)): {fmt(t)}")
    t = time_cuda(lambda: logits.fill_(float("-inf")), warmup=args.warmup, rounds=args.rounds, iters=args.iters)
    r["fill_neg_inf_only"] = t
    log(f"{key}   of which out.fill_(-inf) alone: {fmt(t)}")
    save()
    run_logits()

    # -- top-k
    lg2 = logits.view(S, N)
    seq_lens = (torch.arange(S, dtype=torch.int32, device=dev) + (q0 + 1)).clamp(max=N).contiguous()
    plan = TOPK_PLANS.get((S, N, K))
    if plan is None:
        plan = IndexerTopK(sample_input_values=lg2, sample_seq_lens=seq_lens, top_k=K, next_n=1, return_val=False)
        plan.check_support()
        log(f"{key} top-k: IndexerTopK.compile() (JIT) ...")
        t0 = time.time()
        plan.compile()
        r["topk_plan_compile_s"] = time.time() - t0
        log(f"{key} top-k: compiled in {r['topk_plan_compile_s']:.1f}s")
        TOPK_PLANS[(S, N, K)] = plan
    ws = torch.empty(plan.scratch_workspace_bytes(), dtype=torch.uint8, device=dev)
    idx = torch.empty(S, K, dtype=torch.int32, device=dev)
    r["topk_workspace_bytes"] = int(ws.numel())

    def run_topk():
        return plan.execute(lg2, seq_lens, out_indices=idx, out_values=None, workspace=ws)

    _, r["topk_first_call_s"] = timed_first_call(f"{key} top-k", run_topk)

    # -- check: cuDNN's selection against torch.topk of cuDNN's own logits
    try:
        rows = sorted({0, 1, 2, S // 2, S - 2, S - 1})
        ov, ok = [], []
        for s in rows:
            L = int(min(s + q0 + 1, N))
            sel = idx[s].long()
            in_range = bool(((sel >= 0) & (sel < L)).all().item())
            distinct = int(torch.unique(sel).numel()) == K
            ref_v, ref_i = torch.topk(lg2[s, :L], K)
            kth = ref_v[-1]
            got_min = lg2[s, sel.clamp(0, N - 1)].min()
            overlap = len(set(ref_i.tolist()) & set(sel.tolist())) / K
            ov.append(overlap)
            ok.append(bool(in_range and distinct and bool((got_min >= kth).item())))
        r["check_topk"] = {"rows": rows, "overlap_vs_torch_topk": ov, "valid_selection": ok}
        log(f"{key} top-k check: overlap {['%.4f' % x for x in ov]}, valid selection {ok}")
    except Exception:  # noqa: BLE001
        r["check_topk_error"] = traceback.format_exc()
        traceback.print_exc()

    t = time_cuda(run_topk, warmup=args.warmup, rounds=args.rounds, iters=args.iters)
    r["topk"] = t
    log(f"{key} top-k (IndexerTopK.execute, fp32 [S,N] in, indices out): {fmt(t)}")
    save()

    def run_both():
        run_logits()
        run_topk()

    t = time_cuda(run_both, warmup=args.warmup, rounds=args.rounds, iters=args.iters)
    r["both"] = t
    log(f"{key} logits + top-k back to back: {fmt(t)}")
    GRAPH_JOBS[key + ".logits"] = run_logits
    GRAPH_JOBS[key + ".topk"] = run_topk
    GRAPH_JOBS[key + ".both"] = run_both


TOPK_PLANS: dict = {}


# ----------------------------------------------------------------------------
# The sparse attention backward
# ----------------------------------------------------------------------------

MLA = {}


def mla_common(args):
    """kv [N, D] bf16 and indices [S, T] int32 shared by both head counts."""
    import torch

    if MLA:
        return MLA["kv"], MLA["idx"]
    dev = torch.device("cuda")
    S, N, T, D = args.S, args.N, args.T, args.D
    g = torch.Generator(device=dev)
    g.manual_seed(4321)
    kv = torch.randn(N, D, generator=g, device=dev).to(torch.bfloat16).contiguous()
    # T distinct random keys per row among the causal-visible ones (n <= s + N - S), random order
    scores = torch.rand(S, N, generator=g, device=dev)
    n = torch.arange(N, device=dev)
    visible = n[None, :] <= (torch.arange(S, device=dev)[:, None] + (N - S))
    scores.masked_fill_(~visible, -1.0)
    top_v, top_i = torch.topk(scores, T, dim=-1)
    assert bool((top_v >= 0).all().item()), "fewer than T visible keys in some row"
    idx = top_i.to(torch.int32).contiguous()
    del scores, visible, top_v, top_i
    MLA.update(kv=kv, idx=idx)
    return kv, idx


def torch_sparse_fwd(q, kv, idx, scale, dv, chunk=64):
    """(out bf16 [S,H,dv], lse f32 [S,H] natural log), float32 math."""
    import torch

    S, H, D = q.shape
    out = torch.empty(S, H, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(S, H, dtype=torch.float32, device=q.device)
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        qc = q[s0:s1].float()
        kc = kv[idx[s0:s1].long()].float()                         # [C, T, D]
        sc = torch.bmm(qc, kc.transpose(1, 2)) * scale             # [C, H, T]
        l_ = torch.logsumexp(sc, dim=-1)
        p = torch.exp(sc - l_[..., None])
        out[s0:s1] = torch.bmm(p, kc[..., :dv]).to(q.dtype)
        lse[s0:s1] = l_
    return out, lse


def torch_sparse_bwd(q, kv, idx, out, dout, lse, scale, dv, chunk=64):
    """(dq f32 [S,H,D], dkv f32 [N,D]) of the same attention, float32 math."""
    import torch

    S, H, D = q.shape
    dq = torch.empty(S, H, D, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape[0], D, dtype=torch.float32, device=q.device)
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        ic = idx[s0:s1].long()
        qc = q[s0:s1].float()
        kc = kv[ic].float()
        p = torch.exp(torch.bmm(qc, kc.transpose(1, 2)) * scale - lse[s0:s1, :, None])
        doc = dout[s0:s1].float()
        dp = torch.bmm(doc, kc[..., :dv].transpose(1, 2))
        delta = (doc * out[s0:s1].float()).sum(-1)
        ds = p * (dp - delta[..., None]) * scale
        dq[s0:s1] = torch.bmm(ds, kc)
        dk = torch.bmm(ds.transpose(1, 2), qc)
        dk[..., :dv] += torch.bmm(p.transpose(1, 2), doc)
        dkv.index_add_(0, ic.reshape(-1), dk.reshape(-1, D))
    return dq, dkv


def rel_err(a, b):
    import torch

    a, b = a.float(), b.float()
    return float((torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item())


def step_bwd(args, H):
    import torch
    from cudnn.deepseek_sparse_attention import SparseAttentionBackward

    dev = torch.device("cuda")
    S, N, T, D, dv = args.S, args.N, args.T, args.D, args.d_v
    scale = D ** -0.5
    key = f"bwd_h{H}"
    flops = 2 * S * H * T * (3 * D + 2 * dv)
    r = RES["cudnn"][key] = {
        "shape": {"S": S, "N": N, "H": H, "T": T, "D": D, "d_v": dv, "softmax_scale": scale, "causal_valid_random_indices": True},
        "flops": flops,
        "call": ("cudnn.deepseek_sparse_attention.SparseAttentionBackward(sample_q=q[S,H,D], sample_kv=kv[N,D], "
                 "sample_out=out[S,H,dv], sample_dout=dout[S,H,dv], sample_lse=lse[S,H] f32 (natural log, KV-only), "
                 "sample_attn_sink=f32[H] (-inf), sample_topk_idxs=int32[S,T], softmax_scale=D**-0.5) "
                 ".check_support(); .compile(); .execute(q, kv, out, dout, lse, attn_sink, topk_idxs, dq, dkv, "
                 "workspace=uint8[scratch_workspace_bytes()], d_sink=f32[H]) -> SM90 sparse_attention_backward/"
                 "_interface_sm90.flash_attn_bwd_sm90 (memset dKV accum + preprocess + main + postprocess)"),
        "inputs_note": "out/lse from a float32 torch reference forward (cuDNN has no SM90 sparse forward)",
    }
    kv, idx = mla_common(args)
    g = torch.Generator(device=dev)
    g.manual_seed(100 + H)
    q = torch.randn(S, H, D, generator=g, device=dev).to(torch.bfloat16).contiguous()
    dout = torch.randn(S, H, dv, generator=g, device=dev).to(torch.bfloat16).contiguous()
    t0 = time.time()
    out, lse = torch_sparse_fwd(q, kv, idx, scale, dv)
    torch.cuda.synchronize()
    log(f"{key}: torch reference forward (out, lse) in {time.time() - t0:.1f}s")
    sink = torch.full((H,), float("-inf"), dtype=torch.float32, device=dev)

    plan = SparseAttentionBackward(sample_q=q, sample_kv=kv, sample_out=out, sample_dout=dout, sample_lse=lse,
                                   sample_attn_sink=sink, sample_topk_idxs=idx, softmax_scale=scale)
    plan.check_support()
    plan.compile()
    ws_bytes = int(plan.scratch_workspace_bytes())
    r["workspace_bytes"] = ws_bytes
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=dev)
    dq = torch.empty_like(q)
    dkv = torch.empty_like(kv)
    d_sink = torch.empty_like(sink)

    def run():
        return plan.execute(q, kv, out, dout, lse, sink, idx, dq, dkv, workspace=ws, d_sink=d_sink)

    _, r["first_call_s"] = timed_first_call(f"{key}", run)

    # -- determinism: two more runs compared bitwise
    try:
        dq1, dkv1, ds1 = dq.clone(), dkv.clone(), d_sink.clone()
        run()
        torch.cuda.synchronize()
        det = {"dq_bitwise_equal": bool(torch.equal(dq, dq1)), "dkv_bitwise_equal": bool(torch.equal(dkv, dkv1)),
               "d_sink_bitwise_equal": bool(torch.equal(d_sink.nan_to_num(), ds1.nan_to_num())),
               "dq_max_abs_diff": float((dq.float() - dq1.float()).abs().max().item()),
               "dkv_max_abs_diff": float((dkv.float() - dkv1.float()).abs().max().item())}
        r["determinism_two_runs"] = det
        log(f"{key} determinism (two runs): {det}")
        del dq1, dkv1, ds1
    except Exception:  # noqa: BLE001
        r["determinism_error"] = traceback.format_exc()
        traceback.print_exc()
    save()

    t = time_cuda(run, warmup=args.warmup, rounds=args.rounds, iters=args.iters)
    t["tflops"] = flops / (t["ms"] * 1e-3) / 1e12
    r["bwd"] = t
    log(f"{key} SparseAttentionBackward.execute: {fmt(t)}  = {t['tflops']:.1f} TFLOP/s")
    save()

    # -- correctness against a float32 torch backward
    if not args.no_checks:
        try:
            run()
            t0 = time.time()
            rdq, rdkv = torch_sparse_bwd(q, kv, idx, out, dout, lse, scale, dv)
            torch.cuda.synchronize()
            chk = {"dq_rel_err": rel_err(dq, rdq), "dkv_rel_err": rel_err(dkv, rdkv),
                   "dkv_V_part_rel_err": rel_err(dkv[:, :dv], rdkv[:, :dv]),
                   "dkv_rope_part_rel_err": rel_err(dkv[:, dv:], rdkv[:, dv:]),
                   "d_sink": [float(x) for x in d_sink[:4].tolist()]}
            r["check_vs_torch_f32"] = chk
            log(f"{key} check vs torch f32 backward ({time.time() - t0:.1f}s): {chk}")
            del rdq, rdkv
        except Exception:  # noqa: BLE001
            r["check_error"] = traceback.format_exc()
            traceback.print_exc()
    GRAPH_JOBS[key] = run


# ----------------------------------------------------------------------------
# The sparse attention forward (SM100-only in cuDNN 1.32): record the refusal
# ----------------------------------------------------------------------------


def step_fwd_probe(args):
    import torch
    from cudnn.deepseek_sparse_attention import SparseAttentionForward

    dev = torch.device("cuda")
    q = torch.zeros(64, 64, 576, dtype=torch.bfloat16, device=dev)
    kv = torch.zeros(256, 576, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(64, 128, dtype=torch.int32, device=dev)
    r = RES["cudnn"]["sparse_fwd"] = {"call": "SparseAttentionForward(sample_q, sample_kv, sample_topk_idxs).check_support()"}
    try:
        SparseAttentionForward(sample_q=q, sample_kv=kv, sample_topk_idxs=idx).check_support()
        r["supported_here"] = True
        r["note"] = "check_support passed: not expected on SM90; not timed by this script"
    except Exception as e:  # noqa: BLE001
        r["supported_here"] = False
        r["refusal"] = f"{type(e).__name__}: {e}"
    log(f"sparse forward probe: {r}")


# ----------------------------------------------------------------------------
# ours, through JAX
# ----------------------------------------------------------------------------


def step_ours(args):
    try:  # hand torch's cached blocks back before XLA allocates
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        import jax_attn_dist
    except ImportError:  # not installed: the source tree (needs its built extension)
        sys.path.insert(0, ROOT)
        import jax_attn_dist
    from bench import git_commit, kernel_build_id
    from indexer_topk_bench import topk_problem
    from sparse_mla_bench import sparse_mla_problem
    from timing import time_calls

    o = RES["ours"]
    o["meta"] = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                 "commit": git_commit(), "kernel_build_id": kernel_build_id(),
                 "jax_attn_dist": getattr(jax_attn_dist, "__version__", None),
                 "kernel_status": str(jax_attn_dist.kernel_status()),
                 "timing": f"benchmarks/timing.time_calls: median of {args.samples} samples of {args.calls} "
                           "back-to-back calls alternating 2 input sets, 3 warm-up calls (bench.py's method)"}
    save()
    S, N, HI, DI, K = args.S, args.N, args.HI, args.DI, args.topk

    def one(name, fn):
        log(f"ours {name}: start")
        t0 = time.time()
        try:
            fn()
            log(f"ours {name}: done in {time.time() - t0:.1f}s")
        except Exception:  # noqa: BLE001
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            RES["errors"]["ours." + name] = tb
        save()

    def topk(fp8):
        name = "indexer_topk_fp8" if fp8 else "indexer_topk"
        sets = [topk_problem(S, N, HI, DI, seed, fp8) for seed in (0, 1)]
        kw = sets[0][1]
        arg_sets = [a for a, _ in sets]
        f = jax.jit(lambda a, b, c: jax_attn_dist.indexer_topk(a, b, c, topk=K, implementation="cuda", **kw))
        t0 = time.time()
        jax.block_until_ready(f(*arg_sets[0]))
        c = time.time() - t0
        t = time_calls(f, arg_sets, calls=args.calls, samples=args.samples)
        o[name] = {"ms": t * 1e3, "first_call_s": c,
                   "call": f"jax_attn_dist.indexer_topk(index_q[S,HI,DI], index_k[N,DI], weights[S,HI] f32, topk={K}, "
                           f"implementation='cuda', {', '.join(f'{k}=...' for k in kw)})"}
        log(f"ours {name}: {t * 1e3:.4f} ms/call")

    mla = {}

    def mla_sets(H):
        if H not in mla:
            mla[H] = [sparse_mla_problem(S, N, H, args.T, args.D, args.d_v, seed) for seed in (0, 1)]
        return mla[H]

    def fwd(H):
        sets = mla_sets(H)
        kw = sets[0][1]
        arg_sets = [a for a, _, _ in sets]
        f = jax.jit(lambda q, kv, i: jax_attn_dist.sparse_mla(q, kv, i, implementation="cuda", **kw))
        jax.block_until_ready(f(*arg_sets[0]))
        t = time_calls(f, arg_sets, calls=args.calls, samples=args.samples)
        flops = 2 * S * H * args.T * (args.D + args.d_v)
        o[f"sparse_mla_fwd_h{H}"] = {"ms": t * 1e3, "tflops": flops / t / 1e12}
        log(f"ours sparse_mla fwd H{H}: {t * 1e3:.4f} ms/call ({flops / t / 1e12:.1f} TFLOP/s)")

    def bwd(H, deterministic):
        sets = mla_sets(H)
        kw = dict(sets[0][1], deterministic=deterministic)
        rng = np.random.default_rng(0)
        cot = (jnp.asarray(rng.standard_normal((S, H, args.d_v)).astype(np.float32), jnp.bfloat16),
               jnp.asarray(rng.standard_normal((S, H)).astype(np.float32)))
        arg_sets = [a + cot for a, _, _ in sets]

        def fb(q, kv, i, dout, dlse):
            _, vjp = jax.vjp(lambda q, kv: jax_attn_dist.sparse_mla(q, kv, i, implementation="cuda", **kw), q, kv)
            return vjp((dout, dlse))

        both = jax.jit(fb)
        alone = jax.jit(lambda q, kv, i, dout, dlse: jax_attn_dist.sparse_mla(q, kv, i, implementation="cuda", **kw))
        jax.block_until_ready(both(*arg_sets[0]))
        jax.block_until_ready(alone(*arg_sets[0]))
        t_both = time_calls(both, arg_sets, calls=args.calls, samples=args.samples)
        t_fwd = time_calls(alone, arg_sets, calls=args.calls, samples=args.samples)
        t = t_both - t_fwd
        flops = 2 * S * H * args.T * (3 * args.D + 2 * args.d_v)
        name = f"sparse_mla_bwd{'_det' if deterministic else ''}_h{H}"
        o[name] = {"ms": t * 1e3, "fwd_bwd_ms": t_both * 1e3, "fwd_ms": t_fwd * 1e3, "tflops": flops / t / 1e12,
                   "note": "backward = (fwd + vjp) - fwd, cotangents on out and lse (sparse_mla_bench.py)"}
        log(f"ours {name}: {t * 1e3:.4f} ms (fwd+bwd {t_both * 1e3:.4f}, fwd {t_fwd * 1e3:.4f})")

    one("indexer_topk", lambda: topk(False))
    if not args.no_fp8:
        one("indexer_topk_fp8", lambda: topk(True))
    for H in args.heads:
        one(f"sparse_mla_fwd_h{H}", lambda H=H: fwd(H))
        one(f"sparse_mla_bwd_h{H}", lambda H=H: bwd(H, False))
        if args.ours_det:
            one(f"sparse_mla_bwd_det_h{H}", lambda H=H: bwd(H, True))
        mla.pop(H, None)


def step_graphs(args):
    g = RES["cudnn"].setdefault("cuda_graph", {
        "note": f"the same calls captured once in a CUDA graph of {args.iters} calls; replayed "
                f"{args.rounds} times between CUDA events; median ms per call"})
    for name, fn in list(GRAPH_JOBS.items()):
        log(f"graph {name}: capture + time")
        try:
            t = time_graph(fn, warmup=1, rounds=args.rounds, iters=args.iters)
            g[name] = t
            log(f"graph {name}: {fmt(t)}")
        except Exception:  # noqa: BLE001
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            RES["errors"]["graph." + name] = tb
        save()


# ----------------------------------------------------------------------------


def meta(args, used_sites):
    import importlib.metadata as md

    m = RES["meta"]
    m.update(argv=sys.argv, python=sys.version, platform=platform.platform(), cudnn_site=used_sites,
             started=time.strftime("%Y-%m-%d %H:%M:%S"))
    for dist in ("nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                 "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu13", "cuda-bindings", "apache-tvm-ffi",
                 "torch", "jax", "jaxlib"):
        try:
            m.setdefault("dists", {})[dist] = md.version(dist)
        except Exception:  # noqa: BLE001
            m.setdefault("dists", {})[dist] = None
    try:
        import torch

        m.update(torch=torch.__version__, torch_cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0),
                 capability=list(torch.cuda.get_device_capability(0)),
                 sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    except Exception:  # noqa: BLE001
        m["torch_error"] = traceback.format_exc()
    save()


def main(argv=None) -> int:
    global OUT_PATH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = os.path.join(os.environ["OUT"], "cudnn_peers.json") if os.environ.get("OUT") else "cudnn_peers.json"
    ap.add_argument("--out", default=default_out, help="JSON path (default $OUT/cudnn_peers.json)")
    ap.add_argument("--cudnn-site", default=None, help="pip --target folder of the cuDNN wheels (default "
                                                       "$CUDNN_SITE, /tmp/cudnn_site, PYTHONPATH entries)")
    ap.add_argument("--steps", nargs="+", default=["idx", "bwd-h128", "bwd-h64", "idx-fp8", "fwd-probe", "ours", "graphs"],
                    help="steps to run, in this order (ours runs only with --ours)")
    ap.add_argument("--ours", action="store_true", help="also time jax_attn_dist's kernels (same process)")
    ap.add_argument("--ours-det", action="store_true", help="also ours' deterministic backward")
    ap.add_argument("--no-fp8", action="store_true", help="skip the float8 indexer (cuDNN and ours)")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--no-checks", action="store_true", help="skip the torch float32 backward check")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip the steps that would start after this "
                                                                "many seconds (0: no limit)")
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--HI", type=int, default=64)
    ap.add_argument("--DI", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--D", type=int, default=576)
    ap.add_argument("--d-v", type=int, default=512)
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 64], help="ours' sparse_mla head counts")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--calls", type=int, default=10, help="ours: calls per sample (bench.py)")
    ap.add_argument("--samples", type=int, default=5, help="ours: samples (bench.py)")
    args = ap.parse_args(argv)
    OUT_PATH = args.out
    log(f"writing {OUT_PATH}; steps {args.steps}; ours={args.ours}; {vars(args)}")

    RES["shapes"] = {
        "idx-v32": {"S": args.S, "N": args.N, "HI": args.HI, "DI": args.DI, "topk": args.topk,
                    "causal": True, "q_start_index": args.N - args.S},
        "mla-v32": {"S": args.S, "N": args.N, "H": list(args.heads), "T": args.T, "D": args.D, "d_v": args.d_v,
                    "sm_scale": args.D ** -0.5},
    }
    RES["notes"] = {
        "timing": f"cuDNN: {args.warmup} warm-up calls, then {args.rounds} rounds of {args.iters} back-to-back calls "
                  "between CUDA events on torch's current stream; 'ms' = median round's ms per call. One input set.",
        "sm90_paths": {
            "indexer_forward": "yes: indexer_forward_wrapper -> _interface_sm90.indexer_fwd (bf16, and fp8 with "
                               "per-token fp32 descales); dense [B,S_q,S_k] f32 scores",
            "indexer_forward_top_k_wrapper (fused)": "no: SM100-only (raises NotImplementedError on SM90)",
            "indexer_top_k": "yes: IndexerTopK / indexer_top_k_wrapper (SM90+ CuTe DSL radix top-k)",
            "sparse_attention_backward": "yes: SparseAttentionBackward / sparse_attention_backward_wrapper -> "
                                         "_interface_sm90.flash_attn_bwd_sm90 (non-deterministic: atomic dKV; "
                                         "deterministic=True is SM100-only)",
            "sparse_attention_forward": "no: SparseAttentionForward is SM100-family only",
        },
    }
    used = setup_cudnn_site(args.cudnn_site)  # first on sys.path: its cuda-bindings, cutlass, tvm_ffi
    log(f"cuDNN site folders: {used}")
    meta(args, used)
    try:
        import torch  # noqa: F401  (before cudnn, which needs it)
        import cudnn

        RES["meta"]["cudnn_frontend_version"] = getattr(cudnn, "__version__", None)
        RES["meta"]["cudnn_module"] = getattr(cudnn, "__file__", None)
        import cutlass

        RES["meta"]["cutlass_module"] = getattr(cutlass, "__file__", None)
        RES["meta"]["cutlass_version"] = getattr(cutlass, "__version__", None)
        log(f"cudnn frontend {RES['meta']['cudnn_frontend_version']} from {RES['meta']['cudnn_module']}; "
            f"cutlass from {RES['meta']['cutlass_module']}")
        have_cudnn = True
    except Exception:  # noqa: BLE001
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        RES["errors"]["import_cudnn"] = tb
        have_cudnn = False
    save()
    log(f"GPU: {RES['meta'].get('gpu')} cc {RES['meta'].get('capability')}, torch {RES['meta'].get('torch')}")

    steps = {
        "idx": lambda: step_indexer(args, fp8=False),
        "idx-fp8": lambda: step_indexer(args, fp8=True),
        "bwd-h128": lambda: step_bwd(args, 128),
        "bwd-h64": lambda: step_bwd(args, 64),
        "fwd-probe": lambda: step_fwd_probe(args),
        "ours": lambda: step_ours(args),
        "graphs": lambda: step_graphs(args),
    }
    needs_cudnn = {"idx", "idx-fp8", "bwd-h128", "bwd-h64", "fwd-probe"}
    for name in args.steps:
        if name not in steps:
            log(f"unknown step {name!r}; known: {list(steps)}")
            continue
        if name == "ours" and not args.ours:
            continue
        if name == "idx-fp8" and args.no_fp8:
            continue
        if name == "graphs" and (args.no_graphs or not GRAPH_JOBS):
            continue
        if name in needs_cudnn and not have_cudnn:
            log(f"skip {name}: cudnn did not import")
            continue
        if args.budget_s and time.time() - T_START > args.budget_s:
            log(f"skip {name}: past --budget-s {args.budget_s}")
            RES["errors"][name] = "skipped: past --budget-s"
            continue
        run_step(name, steps[name])

    RES["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    RES["meta"]["wall_s"] = time.time() - T_START
    save()
    # summary
    c = RES["cudnn"]
    log("==== summary (ms per call) ====")
    for k in ("indexer_bf16", "indexer_fp8"):
        if k in c:
            log(f"cuDNN {k}: logits {c[k].get('logits', {}).get('ms')}, top-k {c[k].get('topk', {}).get('ms')}, "
                f"both {c[k].get('both', {}).get('ms')}")
    for k in ("bwd_h128", "bwd_h64"):
        if k in c:
            log(f"cuDNN {k}: {c[k].get('bwd', {}).get('ms')} (det: {c[k].get('determinism_two_runs')})")
    if "cuda_graph" in c:
        log("cuDNN graphs: " + ", ".join(f"{k} {v['ms']:.4f}" for k, v in c["cuda_graph"].items() if isinstance(v, dict)))
    for k, v in RES["ours"].items():
        if isinstance(v, dict) and "ms" in v:
            log(f"ours {k}: {v['ms']:.4f}")
    if RES["errors"]:
        log(f"errors in: {list(RES['errors'])}")
    log(f"wrote {OUT_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
