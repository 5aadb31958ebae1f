"""indexer_topk's benchmark rows (SPEC §9): the kernel against the same
selection on the jnp path under XLA (``implementation="xla"``), and the
floor: the causal logits GEMM (every visible key of every row, HI heads of
DI features: 2 * HI * DI FLOPs per (row, key), about 2 * S * (N - S/2) * HI
* DI with q_start = N - S) at the same run's dense GEMM rate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from timing import extra_memory_bytes, time_calls

# name: (S, N, HI, DI, topk). DeepSeek-V3.2's indexer (SPEC §7), causal, q_start = N - S.
TOPK_SHAPES = {
    "topk-v32": (4096, 8192, 64, 128, 2048),
    "topk-32k": (4096, 32768, 64, 128, 2048),
    "topk-128k": (4096, 131072, 64, 128, 2048),
}
#: The shapes with an XLA row (see sparse_mla_bench.SPARSE_MLA_XLA_SHAPES).
TOPK_XLA_SHAPES = ("topk-v32",)
#: Rows at each end of the problem whose selection is checked against the
#: float64 oracle (SPEC §9.3's acceptance rule).
ORACLE_ROWS = 4


def visible_keys(S, N, q_start, k_stride=1) -> int:
    """The (row, key) pairs of the causal rule (SPEC §9.2): for q_start = N - S,
    S * (N - S/2) + S/2."""
    s = np.arange(S, dtype=np.int64)
    return int(np.clip((q_start + s + 1 - k_stride) // k_stride + 1, 0, N).sum())


def logits_flops(S, N, HI, DI, q_start) -> int:
    """The causal logits GEMM: 2 * HI * DI per visible (row, key)."""
    return 2 * HI * DI * visible_keys(S, N, q_start)


def topk_problem(S, N, HI, DI, seed):
    """((index_q, index_k, weights), indexer_topk keywords): bf16 inputs drawn
    as synthetic.make_indexer draws them (z ~ N(0, 1), weights ~ N(0,
    1/sqrt(HI))), causal with q_start = N - S."""
    kq, kk, kw = jax.random.split(jax.random.key(seed + 7919), 3)
    index_q = (jax.random.normal(kq, (S, HI, DI), jnp.float32) * DI ** -0.25).astype(jnp.bfloat16)
    index_k = (jax.random.normal(kk, (N, DI), jnp.float32) * DI ** -0.25).astype(jnp.bfloat16)
    weights = jax.random.normal(kw, (S, HI), jnp.float32) * HI ** -0.5
    return (index_q, index_k, weights), dict(scale=1.0, causal=True, q_start_index=max(N - S, 0), k_stride=1)


def oracle_check(indices, arrays, kw, topk, rows=ORACLE_ROWS):
    """(rows checked, rows failing): the first and last ``rows`` rows against
    SPEC §9.3's acceptance rule on the float64 logits."""
    from jax_attn_dist import oracle

    iq, ik, w = arrays
    S = iq.shape[0]
    indices = np.asarray(indices)
    checked = bad = 0
    for s0 in sorted({0, max(S - rows, 0)}):
        s1 = min(s0 + rows, S)
        logits = oracle.indexer_topk_logits_oracle(
            iq[s0:s1], ik, w[s0:s1], scale=kw["scale"], causal=kw["causal"],
            q_start_index=kw["q_start_index"] + s0, k_stride=kw["k_stride"])
        for r in range(s1 - s0):
            checked += 1
            bad += oracle.topk_selection_error(logits[r], indices[s0 + r, 0], topk) is not None
    return checked, bad


def bench_indexer_topk(name, dims, *, calls, samples, gemm_tflops, with_xla=True, implementation="cuda"):
    """One row. ``implementation`` is the timed path ("cuda"; the CPU tests
    pass "xla" to run the row's code without a GPU)."""
    import jax_attn_dist

    S, N, HI, DI, topk = dims
    sets = [topk_problem(S, N, HI, DI, seed) for seed in (0, 1)]
    kw = sets[0][1]
    arg_sets = [a for a, _ in sets]
    flops = logits_flops(S, N, HI, DI, kw["q_start_index"])

    def call(impl):
        return jax.jit(lambda a, b, c: jax_attn_dist.indexer_topk(a, b, c, topk=topk, implementation=impl, **kw))

    row = {"name": name, "kind": "indexer_topk", "S": S, "N": N, "HI": HI, "DI": DI, "topk": topk, "flops": flops}
    kernel = call(implementation)
    out_k = kernel(*arg_sets[0])
    t_k = time_calls(kernel, arg_sets, calls=calls, samples=samples)
    floor = flops / (gemm_tflops * 1e12)
    row.update(
        kernel_ms=t_k * 1e3,
        kernel_tflops=flops / t_k / 1e12,
        kernel_frac_gemm=floor / t_k,
        gemm_floor_ms=floor * 1e3,
        kernel_extra_bytes=extra_memory_bytes(kernel, *arg_sets[0]),
    )
    row["oracle_rows_checked"], row["oracle_rows_bad"] = oracle_check(out_k, arg_sets[0], kw, topk)
    if with_xla and name in TOPK_XLA_SHAPES:
        xla = call("xla")
        out_x = xla(*arg_sets[0])
        t_x = time_calls(xla, arg_sets, calls=max(1, calls // 4), samples=samples)
        row.update(
            xla_ms=t_x * 1e3,
            xla_tflops=flops / t_x / 1e12,
            speedup_vs_xla=t_x / t_k,
            xla_extra_bytes=extra_memory_bytes(xla, *arg_sets[0]),
            # the two selections may differ only at near-ties of the cut (SPEC §9.3)
            rows_differing_from_xla=int(np.any(np.asarray(out_k) != np.asarray(out_x), axis=(-2, -1)).sum()),
        )
    return row
