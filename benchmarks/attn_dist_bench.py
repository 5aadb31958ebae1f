"""attn_dist's benchmark rows (SPEC §4): the kernel, the jnp reference under
XLA, FLOPs = 2*B*S*H*T*D."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from timing import extra_memory_bytes, log, time_calls

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

