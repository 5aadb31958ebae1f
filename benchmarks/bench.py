"""Benchmark: the CUDA kernels vs the same work written in XLA vs a dense GEMM.

Everything is timed in one process on one GPU, side by side (docs/SPEC.md §4
and §7):

* ``attn_dist`` shapes (§4): the kernel, the jnp reference under XLA, and a
  dense bf16 8192^3 matmul, the practical ceiling. FLOPs = 2*B*S*H*T*D.
* indexer shapes (§7): ``indexer_kl``'s forward on the kernel, its jnp path,
  and the loss written plainly in XLA (gather + einsum + log_softmax + KL,
  materialised); forward and forward + backward. FLOPs = 2*B*S*HI*T*DI.
* ``step-v32`` (§7): the indexer training step, ``jax.value_and_grad`` of the
  mean ``indexer_loss`` (the attn_dist target of v32-h128, normalised, plus
  the idx-v32 indexer loss, forward and backward) against the same step with
  the indexer loss written in XLA around the attn_dist kernel.
* SPEC §6 rows (``PACKING``): a packed call (4 sequences of 1024 rows) or a
  ``topk_length = T / 2`` call against the same kernel call without §6
  (``ratio`` = §6 time / plain time); for the indexer also its backward.

Timing: each sample enqueues ``--calls`` back-to-back launches of one jitted
call (alternating between two input sets, so repeated runs do not just
re-read one buffer from L2) and blocks once; the per-call time of a sample is
its wall time / calls, and the reported figure is the median over
``--samples`` samples after warm-up. Host dispatch overlaps device work, so
this is device time per call to within the launch gap.

Memory: XLA's own accounting of each compiled call (temporaries + output),
the device memory each path needs beyond its inputs.

    python benchmarks/bench.py                            # everything
    python benchmarks/bench.py --shapes v32-h128 idx-v32 --json results.json

With ``--json X.json`` the results go to X.json and a plot (TFLOP/s per
shape: kernel, XLA, GEMM ceiling) to X.png; ``--plot X.json`` redraws the
plot from a results file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# name: (S, N, H, T, D). SPEC §4 first, then the partial-H / partial-T shapes.
ATTN_SHAPES = {
    "v32-h128": (4096, 8192, 128, 2048, 576),
    "v32-h128-long": (4096, 32768, 128, 2048, 576),
    "v32-h128-128k": (4096, 131072, 128, 2048, 576),
    "v32-h64": (4096, 8192, 64, 2048, 576),
    "small": (1024, 4096, 128, 512, 576),
    "h16-t2048": (4096, 8192, 16, 2048, 576),
    "h96-t2048": (4096, 8192, 96, 2048, 576),
    "h16-t2000": (4096, 8192, 16, 2000, 576),
    "h96-t2000": (4096, 8192, 96, 2000, 576),
    "v32-h128-d512": (4096, 8192, 128, 2048, 512),
}
# name: (S, N, HI, T, DI). SPEC §7 first, then fewer heads.
INDEXER_SHAPES = {
    "idx-v32": (4096, 8192, 64, 2048, 128),
    "idx-v32-128k": (4096, 131072, 64, 2048, 128),
    "idx-h32": (4096, 8192, 32, 2048, 128),
    "idx-h16": (4096, 8192, 16, 2048, 128),
}
STEPS = ("step-v32",)
# SPEC §6 against the same call without it, name: (op, variant). "packed": v32-h128 / idx-v32
# as 4 sequences of 1024 rows (2048 keys each, causal per sequence), against the unpacked
# call on the same indices (the same valid slots, so the same work and output); "topk-half":
# topk_length = T / 2 on every row against full T; "topk-full": topk_length = T (the per-row
# ranges without any saving: what computing, reading and applying them costs).
PACKING = {
    "pack-v32-h128": ("attn_dist", "packed"),
    "topk-half-v32-h128": ("attn_dist", "topk-half"),
    "topk-full-v32-h128": ("attn_dist", "topk-full"),
    "pack-idx-v32": ("indexer", "packed"),
    "topk-half-idx-v32": ("indexer", "topk-half"),
    "topk-full-idx-v32": ("indexer", "topk-full"),
}
ALL = list(ATTN_SHAPES) + list(INDEXER_SHAPES) + list(STEPS) + list(PACKING)


def log(msg: str) -> None:
    print(msg, flush=True)


def time_calls(fn, arg_sets, *, calls: int, samples: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    per_call = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call)


def extra_memory_bytes(jitted, *args) -> int | None:
    """Temporaries + output of one compiled call, as XLA accounts them."""
    try:
        m = jitted.lower(*args).compile().memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def gemm_problem(n: int = 8192):
    """The ceiling's dense bf16 n^3 matmul: (jitted, two input sets, FLOPs)."""
    ka, kb = jax.random.split(jax.random.key(1))
    sets = [
        (jax.random.normal(ka, (n, n), jnp.bfloat16), jax.random.normal(kb, (n, n), jnp.bfloat16)),
        (jax.random.normal(kb, (n, n), jnp.bfloat16), jax.random.normal(ka, (n, n), jnp.bfloat16)),
    ]
    return jax.jit(lambda a, b: a @ b), sets, 2 * n**3


def gemm_ceiling(calls: int, samples: int) -> float:
    """TFLOP/s of a dense bf16 8192^3 matmul on random data."""
    mm, sets, flops = gemm_problem()
    t = time_calls(mm, sets, calls=calls, samples=samples)
    return flops / t / 1e12


# ----------------------------------------------------------------------------
# attn_dist
# ----------------------------------------------------------------------------


def bench_attn_dist(name, dims, *, calls, samples, gemm_tflops, with_xla=True):
    import jax_attn_dist
    from jax_attn_dist import oracle, synthetic

    S, N, H, T, D = dims
    probs = [synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=seed) for seed in (0, 1)]
    kw = probs[0].kwargs
    flops = probs[0].flops
    arg_sets = [p.arrays for p in probs]

    kernel = jax.jit(lambda q, k, i, l: jax_attn_dist.attn_dist(q, k, i, l, implementation="cuda", **kw))
    xla = jax.jit(lambda q, k, i, l: jax_attn_dist.attn_dist(q, k, i, l, implementation="xla", **kw))

    row = {"name": name, "kind": "attn_dist", "S": S, "N": N, "H": H, "T": T, "D": D, "flops": flops}
    out_k = kernel(*arg_sets[0])
    t_k = time_calls(kernel, arg_sets, calls=calls, samples=samples)
    row.update(
        kernel_ms=t_k * 1e3,
        kernel_tflops=flops / t_k / 1e12,
        kernel_frac_gemm=flops / t_k / 1e12 / gemm_tflops,
        kernel_extra_bytes=extra_memory_bytes(kernel, *arg_sets[0]),
        invariant_error=synthetic.invariant_error(out_k, probs[0].lse),
    )
    if with_xla:
        out_x = xla(*arg_sets[0])
        t_x = time_calls(xla, arg_sets, calls=max(1, calls // 2), samples=samples)
        rel, max_rel = oracle.spec_errors(out_k, out_x)
        row.update(
            xla_ms=t_x * 1e3,
            xla_tflops=flops / t_x / 1e12,
            speedup_vs_xla=t_x / t_k,
            xla_extra_bytes=extra_memory_bytes(xla, *arg_sets[0]),
            rel_err_vs_xla=rel,
            max_err_vs_xla_rel_to_max=max_rel,
        )
    return row


# ----------------------------------------------------------------------------
# the indexer loss
# ----------------------------------------------------------------------------


def xla_indexer_kl(index_q, index_k, weights, indices, target, *, scale, causal, q_start_index, k_stride):
    """SPEC §5's loss written plainly in XLA, as a user would without the
    package: gather + einsum + relu-weighted sum + masked log_softmax + KL,
    everything materialised ([S, HI, T] float32 scores)."""
    S, HI, DI = index_q.shape
    N = index_k.shape[0]
    idx = indices[:, 0, :]
    valid = (idx >= 0) & (idx < N)
    if causal:
        limit = jnp.floor_divide(q_start_index + jnp.arange(S) + 1 - k_stride, k_stride)
        valid &= idx <= limit[:, None]
    kg = index_k[jnp.clip(idx, 0, N - 1)]                                        # [S, T, DI]
    z = jnp.einsum("shd,std->sht", index_q, kg, preferred_element_type=jnp.float32)
    logits = scale * jnp.einsum("sh,sht->st", weights.astype(jnp.float32), jax.nn.relu(z))
    log_p = jax.nn.log_softmax(jnp.where(valid, logits, -1e30), axis=-1)
    t = jnp.where(valid & (target > 0), target, 0.0)
    pos = t > 0
    return jnp.sum(jnp.where(pos, t * (jnp.log(jnp.where(pos, t, 1.0)) - log_p), 0.0), axis=-1)


def indexer_problem(S, N, HI, T, DI, seed):
    """Causal top-k indices (from the synthetic generator, with a cheap main
    attention), an indexer, and a random target over the valid slots."""
    from jax_attn_dist import synthetic

    p = synthetic.make_problem(S=S, N=N, H=1, T=T, D=64, seed=seed)
    ix = synthetic.make_indexer(p, HI=HI, DI=DI, seed=seed)
    u = jax.random.uniform(jax.random.key(seed + 99), (S, T), jnp.float32)
    t = jnp.where(p.indices[:, 0, :] >= 0, u, 0.0)
    target = t / jnp.maximum(t.sum(-1, keepdims=True), 1e-30)
    return (*ix.arrays, p.indices, target), dict(scale=1.0, causal=True, q_start_index=p.q_start_index, k_stride=1)


def indexer_backward(arg_kw_sets):
    """indexer_kl's backward alone: for each (arrays, keywords), jax.vjp's
    function (its residuals computed beforehand) and a mean-loss cotangent,
    and one jitted call that applies them."""
    import jax_attn_dist

    pairs = []
    for a, kw in arg_kw_sets:
        f = lambda iq, ik, w, a=a, kw=kw: jax_attn_dist.indexer_kl(iq, ik, w, *a[3:], **kw)  # noqa: E731
        out, vjp = jax.vjp(f, *a[:3])
        pairs.append((vjp, jnp.full(out.shape, 1.0 / out.size, jnp.float32)))
    return jax.jit(lambda vjp, g: vjp(g)), pairs


def bench_indexer(name, dims, *, calls, samples, gemm_tflops, with_xla=True):
    import jax_attn_dist
    from jax_attn_dist import oracle

    S, N, HI, T, DI = dims
    sets = [indexer_problem(S, N, HI, T, DI, seed) for seed in (0, 1)]
    kw = sets[0][1]
    arg_sets = [a for a, _ in sets]
    flops = 2 * S * HI * T * DI
    row = {"name": name, "kind": "indexer", "S": S, "N": N, "HI": HI, "T": T, "DI": DI, "flops": flops}

    def fwd(impl):
        if impl == "plain":
            return jax.jit(lambda *a: xla_indexer_kl(*a, **kw))
        return jax.jit(lambda *a: jax_attn_dist.indexer_kl(*a, implementation=impl, **kw))

    def fwd_bwd(impl):
        loss = (lambda *a: xla_indexer_kl(*a, **kw).mean()) if impl == "plain" else (
            lambda *a: jax_attn_dist.indexer_kl(*a, implementation=impl, **kw).mean())
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    kernel = fwd("cuda")
    out_k = kernel(*arg_sets[0])
    for deterministic, key in ((False, "kernel_bwd_ms"), (True, "bwd_deterministic_ms")):
        b, pairs = indexer_backward([(a, dict(kw, deterministic=deterministic)) for a in arg_sets])
        row[key] = time_calls(b, pairs, calls=calls, samples=samples) * 1e3
        log(f"  {name}: backward (deterministic={deterministic}) {row[key]:.3f} ms")
    t_k = time_calls(kernel, arg_sets, calls=calls, samples=samples)
    kb = fwd_bwd("cuda")
    t_kb = time_calls(kb, arg_sets, calls=max(1, calls // 2), samples=samples)
    row.update(kernel_ms=t_k * 1e3, kernel_tflops=flops / t_k / 1e12, kernel_frac_gemm=flops / t_k / 1e12 / gemm_tflops,
               kernel_extra_bytes=extra_memory_bytes(kernel, *arg_sets[0]),
               kernel_fwd_bwd_ms=t_kb * 1e3, kernel_fwd_bwd_extra_bytes=extra_memory_bytes(kb, *arg_sets[0]),
               gather_bytes=S * T * DI * 2)
    if with_xla:
        for impl, key in (("xla", "jnp"), ("plain", "xla")):
            f = fwd(impl)
            out = f(*arg_sets[0])
            t = time_calls(f, arg_sets, calls=max(1, calls // 4), samples=samples)
            fb = fwd_bwd(impl)
            t_b = time_calls(fb, arg_sets, calls=max(1, calls // 4), samples=samples)
            row.update({f"{key}_ms": t * 1e3, f"{key}_tflops": flops / t / 1e12,
                        f"{key}_extra_bytes": extra_memory_bytes(f, *arg_sets[0]),
                        f"{key}_fwd_bwd_ms": t_b * 1e3, f"{key}_fwd_bwd_extra_bytes": extra_memory_bytes(fb, *arg_sets[0]),
                        f"max_err_vs_{key}": oracle.indexer_error(out_k, out)})
        row.update(speedup_vs_xla=row["xla_ms"] / row["kernel_ms"],
                   fwd_bwd_speedup_vs_xla=row["xla_fwd_bwd_ms"] / row["kernel_fwd_bwd_ms"])
    return row


def bench_step(name, *, calls, samples, gemm_tflops, with_xla=True):
    """step-v32: value_and_grad of the mean indexer_loss (target from the
    v32-h128 attn_dist, idx-v32 indexer), vs the same step with the indexer
    loss in XLA around the attn_dist kernel."""
    import jax_attn_dist
    from jax_attn_dist import synthetic

    S, N, H, T, D = ATTN_SHAPES["v32-h128"]
    HI, DI = INDEXER_SHAPES["idx-v32"][2], INDEXER_SHAPES["idx-v32"][4]
    sets = []
    for seed in (0, 1):
        p = synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, lse_base="e", seed=seed)
        ix = synthetic.make_indexer(p, HI=HI, DI=DI, seed=seed)
        sets.append((p.q, p.k, p.lse, *ix.arrays, p.indices))
    kw = dict(sm_scale=p.sm_scale, lse_base="e", causal=True, q_start_index=p.q_start_index, k_stride=1)

    def ours(q, k, lse, iq, ik, w, idx):
        loss = lambda iq, ik, w: jax_attn_dist.indexer_loss(q, k, lse, iq, ik, w, idx, **kw).mean()  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, w)

    def theirs(q, k, lse, iq, ik, w, idx):
        dist = jax_attn_dist.attn_dist(q, k, idx, lse, implementation="cuda", **kw)
        mass = dist.sum(axis=0)
        total = mass.sum(-1, keepdims=True)
        target = jax.lax.stop_gradient(jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), 0.0))
        rule = dict(causal=True, q_start_index=kw["q_start_index"], k_stride=1, scale=1.0)
        loss = lambda iq, ik, w: xla_indexer_kl(iq, ik, w, idx, target, **rule).mean()  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, w)

    row = {"name": name, "kind": "step", "S": S, "N": N, "H": H, "T": T, "D": D, "HI": HI, "DI": DI,
           "flops": 2 * S * T * (H * D + 3 * HI * DI)}
    f = jax.jit(ours)
    (v_ours, _) = f(*sets[0])
    t = time_calls(f, sets, calls=max(1, calls // 2), samples=samples)
    row.update(kernel_ms=t * 1e3, kernel_extra_bytes=extra_memory_bytes(f, *sets[0]))
    if with_xla:
        g = jax.jit(theirs)
        (v_theirs, _) = g(*sets[0])
        t_x = time_calls(g, sets, calls=max(1, calls // 4), samples=samples)
        row.update(xla_ms=t_x * 1e3, xla_extra_bytes=extra_memory_bytes(g, *sets[0]), speedup_vs_xla=t_x / t,
                   loss=float(v_ours), loss_xla=float(v_theirs))
    return row


# ----------------------------------------------------------------------------
# packed sequences and per-row top-k lengths (SPEC §6)
# ----------------------------------------------------------------------------


def packed_layout(S, N, T, *, num_seqs, seed):
    """4 (``num_seqs``) sequences of S / num_seqs query rows and N / num_seqs
    keys, each query causal in its sequence at position ``S / num_seqs + r``
    (so it sees at least S / num_seqs + 1 keys), and T indices per row drawn
    from its visible keys (repeats where fewer than T are visible): every
    slot valid, as in the unpacked SPEC §4 problem. Returns (indices [S, 1, T],
    cu_seqlens_q, cu_seqlens_k, q_start [num_seqs])."""
    rows, keys = S // num_seqs, N // num_seqs
    r = np.arange(S) % rows
    seq = np.arange(S) // rows
    visible = np.minimum(rows + r + 1, keys)
    u = np.random.default_rng(seed).integers(0, 1 << 30, (S, T))
    idx = seq[:, None] * keys + u % visible[:, None]
    cu_q = np.arange(num_seqs + 1) * rows
    cu_k = np.arange(num_seqs + 1) * keys
    as_i32 = lambda x: jnp.asarray(np.asarray(x).astype(np.int32))  # noqa: E731
    return as_i32(idx[:, None, :]), as_i32(cu_q), as_i32(cu_k), as_i32(np.full(num_seqs, rows))


def time_pair(f_base, f_var, base_sets, var_sets, *, calls, samples):
    """(base seconds, variant seconds): each timed twice, interleaved, the
    faster kept (the two stay comparable through clock and thermal drift)."""
    tb, tv = [], []
    for _ in range(2):
        tb.append(time_calls(f_base, base_sets, calls=calls, samples=samples))
        tv.append(time_calls(f_var, var_sets, calls=calls, samples=samples))
    return min(tb), min(tv)


def bench_packing(name, *, calls, samples, gemm_tflops, with_xla=True):
    """A SPEC §6 call against the same call without §6 (see PACKING). For
    attn_dist the forward; for the indexer its forward and backward (float32
    mode). ``ratio`` = variant / baseline; ``max_abs_diff`` compares the
    outputs (packed: identical valid slots, so 0; topk-half/-full: the first
    topk_length slots, the rest must be 0)."""
    import jax_attn_dist
    from jax_attn_dist import synthetic
    from jax_attn_dist.ops.attn_dist import reference

    del with_xla, gemm_tflops
    op, variant = PACKING[name]
    row = {"name": name, "kind": "packing", "op": op, "variant": variant}
    if op == "attn_dist":
        S, N, H, T, D = ATTN_SHAPES["v32-h128"]
        row.update(S=S, N=N, H=H, T=T, D=D)
    else:
        S, N, HI, T, DI = INDEXER_SHAPES["idx-v32"]
        row.update(S=S, N=N, HI=HI, T=T, DI=DI)
    half = jnp.full((S,), T // 2 if variant == "topk-half" else T, jnp.int32)  # topk_length

    if op == "attn_dist":
        if variant == "packed":
            base_sets, var_sets = [], []
            for seed in (0, 1):
                idx, cu_q, cu_k, qs = packed_layout(S, N, T, num_seqs=4, seed=seed)
                kq, kk = jax.random.split(jax.random.key(seed))
                q = jax.random.normal(kq, (S, H, D), jnp.bfloat16)
                k = jax.random.normal(kk, (N, 1, D), jnp.bfloat16)
                lse = reference.exact_lse_canonical(q[None], k[None], idx[None], jnp.zeros((1,), jnp.int32),
                                                    sm_scale=D ** -0.5, causal=False, k_stride=1, lse_base="2")[0]
                base_sets.append((q, k, idx, lse))
                var_sets.append((q, k, idx, lse, cu_q, cu_k, qs))
            kw = dict(sm_scale=D ** -0.5, implementation="cuda")
            base = jax.jit(lambda q, k, i, l: jax_attn_dist.attn_dist(q, k, i, l, causal=False, **kw))
            var = jax.jit(lambda q, k, i, l, cq, ck, qs: jax_attn_dist.attn_dist(
                q, k, i, l, causal=True, q_start_index=qs, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw))
            diff = float(jnp.abs(base(*base_sets[0]) - var(*var_sets[0])).max())
        else:
            probs = [synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=seed) for seed in (0, 1)]
            kw = dict(probs[0].kwargs, implementation="cuda")
            base_sets = [p.arrays for p in probs]
            var_sets = [(*p.arrays, half) for p in probs]
            base = jax.jit(lambda q, k, i, l: jax_attn_dist.attn_dist(q, k, i, l, **kw))
            var = jax.jit(lambda q, k, i, l, n: jax_attn_dist.attn_dist(q, k, i, l, topk_length=n, **kw))
            full, part = base(*base_sets[0]), var(*var_sets[0])
            n = int(half[0])
            assert not np.asarray(part[..., n:]).any()
            diff = float(jnp.abs(full[..., :n] - part[..., :n]).max())
        t_base, t_var = time_pair(base, var, base_sets, var_sets, calls=calls, samples=samples)
        row.update(baseline_ms=t_base * 1e3, kernel_ms=t_var * 1e3, ratio=t_var / t_base, max_abs_diff=diff,
                   kernel_extra_bytes=extra_memory_bytes(var, *var_sets[0]))
        return row

    # the indexer: forward, and the backward alone (jax.vjp's function)
    if variant == "packed":
        base_sets, var_sets = [], []
        for seed in (0, 1):
            idx, cu_q, cu_k, qs = packed_layout(S, N, T, num_seqs=4, seed=seed)
            ks = jax.random.split(jax.random.key(seed + 7), 4)
            iq = jax.random.normal(ks[0], (S, HI, DI), jnp.bfloat16)
            ik = jax.random.normal(ks[1], (N, DI), jnp.bfloat16)
            w = jax.random.normal(ks[2], (S, HI), jnp.float32) * HI ** -0.5
            u = jax.random.uniform(ks[3], (S, T), jnp.float32)
            tgt = u / u.sum(-1, keepdims=True)
            base_sets.append(((iq, ik, w, idx, tgt), dict(causal=False)))
            var_sets.append(((iq, ik, w, idx, tgt), dict(causal=True, q_start_index=qs, cu_seqlens_q=cu_q,
                                                             cu_seqlens_k=cu_k)))
    else:
        sets = [indexer_problem(S, N, HI, T, DI, seed) for seed in (0, 1)]
        base_sets = [(a, dict(kw)) for a, kw in sets]
        var_sets = [(a, dict(kw, topk_length=half)) for a, kw in sets]

    def forward(pair_sets):
        # the §6 arrays are passed as traced operands (as a training step would)
        keys = sorted(k for k, v in pair_sets[0][1].items() if not isinstance(v, (bool, int, float)))
        static = {k: v for k, v in pair_sets[0][1].items() if k not in keys}
        f = jax.jit(lambda a, dyn: jax_attn_dist.indexer_kl(*a, implementation="cuda", **static,
                                                             **dict(zip(keys, dyn))))
        return f, [(a, tuple(kw[k] for k in keys)) for a, kw in pair_sets]

    (fb, fb_sets), (fv, fv_sets) = forward(base_sets), forward(var_sets)
    kl_b, kl_v = fb(*fb_sets[0]), fv(*fv_sets[0])
    t_base, t_var = time_pair(fb, fv, fb_sets, fv_sets, calls=calls, samples=samples)
    (bb, bb_sets), (bv, bv_sets) = indexer_backward(base_sets), indexer_backward(var_sets)
    tb_base, tb_var = time_pair(bb, bv, bb_sets, bv_sets, calls=calls, samples=samples)
    row.update(baseline_ms=t_base * 1e3, kernel_ms=t_var * 1e3, ratio=t_var / t_base,
               baseline_bwd_ms=tb_base * 1e3, kernel_bwd_ms=tb_var * 1e3, bwd_ratio=tb_var / tb_base)
    if variant == "packed":
        row["max_abs_diff"] = float(jnp.abs(kl_b - kl_v).max())
    return row


# ----------------------------------------------------------------------------
# driver, table, plot
# ----------------------------------------------------------------------------


def git_commit() -> str:
    if os.environ.get("JAX_ATTN_DIST_COMMIT"):  # the device copy of the tree has no .git
        return os.environ["JAX_ATTN_DIST_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def table(result) -> str:
    gb = lambda b: (b or 0) / 1e9  # noqa: E731
    lines = [f"{'shape':<16}{'kernel ms':>10}{'TFLOP/s':>9}{'of GEMM':>8}{'XLA ms':>9}{'speedup':>8}"
             f"{'XLA tmp GB':>11}{'fwd+bwd ms':>11}{'XLA f+b ms':>11}{'bwd ms':>9}{'det bwd':>9}{'§6 ratio':>9}"]
    for r in result["rows"]:
        tf = r.get("kernel_tflops")
        lines.append(
            f"{r['name']:<16}{r['kernel_ms']:>10.3f}{tf if tf is not None else float('nan'):>9.0f}"
            f"{r.get('kernel_frac_gemm', float('nan')):>8.0%}{r.get('xla_ms', float('nan')):>9.2f}"
            f"{r.get('speedup_vs_xla', float('nan')):>7.2f}x{gb(r.get('xla_extra_bytes')):>11.2f}"
            f"{r.get('kernel_fwd_bwd_ms', float('nan')):>11.3f}{r.get('xla_fwd_bwd_ms', float('nan')):>11.2f}"
            f"{r.get('kernel_bwd_ms', float('nan')):>9.3f}{r.get('bwd_deterministic_ms', float('nan')):>9.2f}"
            f"{r.get('ratio', float('nan')):>9.3f}")
    return "\n".join(lines)


def plot(result, path: str) -> str | None:
    """TFLOP/s per shape: kernel, XLA, and the same-run GEMM ceiling."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plot: matplotlib is not installed; skipped (python benchmarks/bench.py --plot X.json redraws it)")
        return None
    rows = [r for r in result["rows"] if r.get("kernel_tflops") is not None]
    groups = [("attn_dist (FLOPs = 2 S H T D)", [r for r in rows if r["kind"] == "attn_dist"]),
              ("indexer_kl forward (FLOPs = 2 S HI T DI)", [r for r in rows if r["kind"] == "indexer"])]
    groups = [(title, rs) for title, rs in groups if rs]
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.8), squeeze=False)
    for ax, (title, rs) in zip(axes[0], groups):
        x = np.arange(len(rs))
        ax.bar(x - 0.2, [r["kernel_tflops"] for r in rs], 0.4, label="CUDA kernel")
        ax.bar(x + 0.2, [r.get("xla_tflops", 0.0) for r in rs], 0.4, label="XLA")
        ax.axhline(result["gemm_8192_tflops"], color="k", ls="--", lw=1,
                   label=f"dense bf16 GEMM ({result['gemm_8192_tflops']:.0f})")
        for xi, r in zip(x, rs):
            ax.text(xi - 0.2, r["kernel_tflops"], f"{r['kernel_ms']:.2f} ms", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [r["name"] for r in rs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"jax_attn_dist {result['commit']} on {result['device']}, jax {result['jax']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=ALL, choices=ALL)
    ap.add_argument("--calls", type=int, default=10, help="launches per timed sample")
    ap.add_argument("--samples", type=int, default=15, help="timed samples (median reported)")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA baselines")
    ap.add_argument("--json", default=None, help="write the results here (and a plot next to it)")
    ap.add_argument("--plot", default=None, metavar="JSON", help="only redraw the plot of a results file")
    args = ap.parse_args(argv)

    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        result.setdefault("rows", result.get("shapes", []))
        for r in result["rows"]:
            r.setdefault("kind", "attn_dist")
        log(f"plot: {plot(result, os.path.splitext(args.plot)[0] + '.png')}")
        return 0

    import jax_attn_dist

    if jax.default_backend() != "gpu" or not jax_attn_dist.kernel_available():
        print("bench.py needs a CUDA GPU and the built kernel", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    t0 = time.perf_counter()
    gemm = gemm_ceiling(args.calls, args.samples)
    result = {
        "device": dev.device_kind, "jax": jax.__version__, "python": platform.python_version(),
        "commit": git_commit(), "gemm_8192_tflops": gemm,
        "timing": f"median of {args.samples} samples x {args.calls} back-to-back calls, 2 input sets",
        "rows": [],
    }
    log(f"{dev.device_kind}  jax {jax.__version__}  dense bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s")
    opts = dict(calls=args.calls, samples=args.samples, gemm_tflops=gemm, with_xla=not args.no_xla)
    for i, name in enumerate(args.shapes, 1):
        log(f"[{i}/{len(args.shapes)}] {name} ... ({time.perf_counter() - t0:.0f} s elapsed)")
        t_shape = time.perf_counter()
        if name in ATTN_SHAPES:
            row = bench_attn_dist(name, ATTN_SHAPES[name], **opts)
        elif name in INDEXER_SHAPES:
            row = bench_indexer(name, INDEXER_SHAPES[name], **opts)
        elif name in PACKING:
            row = bench_packing(name, **opts)
        else:
            row = bench_step(name, **opts)
        row["bench_seconds"] = time.perf_counter() - t_shape
        result["rows"].append(row)
        log(json.dumps(row))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    log("\n" + table(result))
    if args.json:
        log(f"plot: {plot(result, os.path.splitext(args.json)[0] + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
