"""SPEC §6's benchmark rows: a packed call or a ``topk_length`` call against
the same kernel call without §6 (``ratio`` = §6 time / plain time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn_dist_bench import ATTN_SHAPES
from indexer_bench import INDEXER_SHAPES, indexer_backward, indexer_problem
from timing import extra_memory_bytes, time_pair

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
            kw = dict(sm_scale=D ** -0.5, lse_base="2", implementation="cuda")
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

