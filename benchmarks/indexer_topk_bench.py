"""indexer_topk's benchmark rows (SPEC §9): the kernel against the same
selection on the jnp path under XLA (``implementation="xla"``), and the
floor: the causal logits GEMM (every visible key of every row, HI heads of
DI features: 2 * HI * DI FLOPs per (row, key), about 2 * S * (N - S/2) * HI
* DI with q_start = N - S) at the same run's dense GEMM rate (the float8
row: at the rate of a dense float8 GEMM timed in the row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from timing import extra_memory_bytes, gemm_ceiling, time_calls

# name: (S, N, HI, DI, topk[, "fp8"]). DeepSeek-V3.2's indexer (SPEC §7), causal, q_start = N - S;
# "fp8": float8_e4m3fn inputs quantised as topk_problem says.
TOPK_SHAPES = {
    "topk-v32": (4096, 8192, 64, 128, 2048),
    "topk-v32-fp8": (4096, 8192, 64, 128, 2048, "fp8"),
    "topk-32k": (4096, 32768, 64, 128, 2048),
    "topk-128k": (4096, 131072, 64, 128, 2048),
}
#: The shapes with an XLA row (see sparse_mla_bench.SPARSE_MLA_XLA_SHAPES).
TOPK_XLA_SHAPES = ("topk-v32", "topk-v32-fp8")
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


def topk_problem(S, N, HI, DI, seed, fp8=False):
    """((index_q, index_k, weights), indexer_topk keywords): bf16 inputs drawn
    as synthetic.make_indexer draws them (z ~ N(0, 1), weights ~ N(0,
    1/sqrt(HI))), causal with q_start = N - S. ``fp8``: the same values
    quantised as DeepSeek's float8 indexer does, each key row and each
    (row, head) of index_q by its own scale (amax / 448): the key scales are
    ``index_k_scale``, the query scales are folded into ``weights``."""
    kq, kk, kw = jax.random.split(jax.random.key(seed + 7919), 3)
    index_q = jax.random.normal(kq, (S, HI, DI), jnp.float32) * DI ** -0.25
    index_k = jax.random.normal(kk, (N, DI), jnp.float32) * DI ** -0.25
    weights = jax.random.normal(kw, (S, HI), jnp.float32) * HI ** -0.5
    kw = dict(scale=1.0, causal=True, q_start_index=max(N - S, 0), k_stride=1)
    if not fp8:
        return (index_q.astype(jnp.bfloat16), index_k.astype(jnp.bfloat16), weights), kw
    fmax = float(jnp.finfo(jnp.float8_e4m3fn).max)
    q_scale = jnp.max(jnp.abs(index_q), axis=-1) / fmax                              # [S, HI]
    k_scale = jnp.max(jnp.abs(index_k), axis=-1) / fmax                              # [N]
    index_q = (index_q / q_scale[..., None]).astype(jnp.float8_e4m3fn)
    index_k = (index_k / k_scale[..., None]).astype(jnp.float8_e4m3fn)
    return (index_q, index_k, weights * q_scale), dict(kw, index_k_scale=k_scale)


def shape_call(name, seed=0, implementation="cuda"):
    """(f, args): shape `name`'s jitted indexer_topk call and one input set, for
    the tools that run one shape's kernel (profile_kernel.py, timeline.py)."""
    import jax_attn_dist

    S, N, HI, DI, topk = TOPK_SHAPES[name][:5]
    args, kw = topk_problem(S, N, HI, DI, seed, fp8=TOPK_SHAPES[name][5:] == ("fp8",))
    return jax.jit(lambda *a: jax_attn_dist.indexer_topk(*a, topk=topk, implementation=implementation, **kw)), args


def oracle_check(indices, arrays, kw, topk, rows=ORACLE_ROWS, rtol=None):
    """(rows checked, rows failing): the first and last ``rows`` rows against
    SPEC §9.3's acceptance rule (band ``rtol``, the bf16 one by default) on
    the float64 logits."""
    from jax_attn_dist import oracle

    rtol = oracle.TOPK_TOLERANCE if rtol is None else rtol
    k_scale = kw.get("index_k_scale")
    iq, ik, w = arrays
    S = iq.shape[0]
    indices = np.asarray(indices)
    checked = bad = 0
    for s0 in sorted({0, max(S - rows, 0)}):
        s1 = min(s0 + rows, S)
        logits = oracle.indexer_topk_logits_oracle(
            iq[s0:s1], ik, w[s0:s1], scale=kw["scale"], causal=kw["causal"],
            q_start_index=kw["q_start_index"] + s0, k_stride=kw["k_stride"],
            index_k_scale=None if k_scale is None else np.asarray(k_scale))
        for r in range(s1 - s0):
            checked += 1
            bad += oracle.topk_selection_error(logits[r], indices[s0 + r, 0], topk, rtol) is not None
    return checked, bad


def bench_indexer_topk(name, dims, *, calls, samples, gemm_tflops, with_xla=True, implementation="cuda"):
    """One row. ``implementation`` is the timed path ("cuda"; the CPU tests
    pass "xla" to run the row's code without a GPU)."""
    import jax_attn_dist

    S, N, HI, DI, topk = dims[:5]
    fp8 = dims[5:] == ("fp8",)
    sets = [topk_problem(S, N, HI, DI, seed, fp8) for seed in (0, 1)]
    kw = sets[0][1]
    arg_sets = [a for a, _ in sets]
    flops = logits_flops(S, N, HI, DI, kw["q_start_index"])

    def call(impl):
        return jax.jit(lambda a, b, c: jax_attn_dist.indexer_topk(a, b, c, topk=topk, implementation=impl, **kw))

    row = {"name": name, "kind": "indexer_topk", "S": S, "N": N, "HI": HI, "DI": DI, "topk": topk, "flops": flops,
           "dtype": "float8_e4m3fn" if fp8 else "bfloat16"}
    kernel = call(implementation)
    out_k = kernel(*arg_sets[0])
    t_k = time_calls(kernel, arg_sets, calls=calls, samples=samples)
    if fp8:  # the floor at the float8 GEMM rate (the dense bf16 one where XLA's float8 dot is slower)
        row["fp8_gemm_tflops"] = (gemm_ceiling(calls, samples, jnp.float8_e4m3fn) if implementation == "cuda"
                                  else gemm_tflops)
        gemm_tflops = max(gemm_tflops, row["fp8_gemm_tflops"])
    floor = flops / (gemm_tflops * 1e12)
    row.update(
        kernel_ms=t_k * 1e3,
        kernel_tflops=flops / t_k / 1e12,
        kernel_frac_gemm=floor / t_k,
        gemm_floor_ms=floor * 1e3,
        kernel_extra_bytes=extra_memory_bytes(kernel, *arg_sets[0]),
    )
    from jax_attn_dist import oracle

    rtol = oracle.TOPK_TOLERANCE_FP8_KERNEL if fp8 and implementation == "cuda" else oracle.TOPK_TOLERANCE
    row["oracle_rows_checked"], row["oracle_rows_bad"] = oracle_check(out_k, arg_sets[0], kw, topk, rtol=rtol)
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
