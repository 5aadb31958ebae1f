"""sparse_mla's benchmark rows (SPEC §8), forward and backward: the kernels
against the same computation in XLA two ways. ``xla``: written plainly, as a
user would write it for speed without the package
(``plain_xla.xla_sparse_mla``; its backward is XLA's autodiff). ``jnp``: the
package's own jnp path (``implementation="xla"``), the contract's chunked
reference, which forms P.V in float32 at HIGHEST precision (off the tensor
cores on a GPU) and has a chunked backward of its own. FLOPs =
2*B*S*H*T*(D + d_v) (SPEC §8.2: QK^T and PV over every slot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from plain_xla import xla_sparse_mla
from timing import extra_memory_bytes, time_calls

# name: (S, N, H, T, D, d_v). SPEC §4's v32 shapes with d_v = 512 (the MLA latent).
SPARSE_MLA_SHAPES = {
    "mla-v32-h128": (4096, 8192, 128, 2048, 576, 512),
    "mla-v32-h64": (4096, 8192, 64, 2048, 576, 512),
    "mla-128k-h128": (4096, 131072, 128, 2048, 576, 512),
}
#: The shapes with XLA rows (timed only on the v32 shapes, as for the other
#: ops' long rows: they are slow, and the ceiling is the point).
SPARSE_MLA_XLA_SHAPES = ("mla-v32-h128", "mla-v32-h64")


def sparse_mla_flops(S, H, T, D, d_v, B=1) -> int:
    """SPEC §8.2: 2 * B * S * H * T * (D + d_v), every slot counted."""
    return 2 * B * S * H * T * (D + d_v)


def sparse_mla_problem(S, N, H, T, D, d_v, seed):
    """((q, kv, indices), sparse_mla keywords, exact lse): attn_dist's
    synthetic problem (synthetic.make_problem: T distinct keys per row drawn
    uniformly among its causal-visible ones, q_start = N - S), whose exact
    base-2 lse of the same softmax checks the kernel's."""
    from jax_attn_dist import synthetic

    p = synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=seed)
    kw = dict(sm_scale=p.sm_scale, d_v=d_v, causal=p.causal, q_start_index=p.q_start_index, k_stride=p.k_stride,
              lse_base=p.lse_base)
    return (p.q, p.k, p.indices), kw, p.lse


def lse_error(lse, ref) -> float:
    """max |lse - ref| where ref is finite; inf if the non-finite entries differ."""
    lse, ref = np.asarray(lse, np.float64), np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(lse), finite):
        return float("inf")
    return float(np.abs(lse[finite] - ref[finite]).max()) if finite.any() else 0.0


def bench_sparse_mla(name, dims, *, calls, samples, gemm_tflops, with_xla=True, implementation="cuda"):
    """One row. ``implementation`` is the timed path ("cuda"; the CPU tests
    pass "xla" to run the row's code without a GPU)."""
    import jax_attn_dist
    from jax_attn_dist import oracle

    S, N, H, T, D, d_v = dims
    sets = [sparse_mla_problem(S, N, H, T, D, d_v, seed) for seed in (0, 1)]
    kw, exact_lse = sets[0][1], sets[0][2]
    arg_sets = [a for a, _, _ in sets]
    flops = sparse_mla_flops(S, H, T, D, d_v)

    def call(impl):
        return jax.jit(lambda q, kv, i: jax_attn_dist.sparse_mla(q, kv, i, implementation=impl, **kw))

    row = {"name": name, "kind": "sparse_mla", "S": S, "N": N, "H": H, "T": T, "D": D, "d_v": d_v, "flops": flops}
    kernel = call(implementation)
    out_k, lse_k = kernel(*arg_sets[0])
    t_k = time_calls(kernel, arg_sets, calls=calls, samples=samples)
    row.update(
        kernel_ms=t_k * 1e3,
        kernel_tflops=flops / t_k / 1e12,
        kernel_frac_gemm=flops / t_k / 1e12 / gemm_tflops,
        gemm_floor_ms=flops / (gemm_tflops * 1e12) * 1e3,
        kernel_extra_bytes=extra_memory_bytes(kernel, *arg_sets[0]),
        lse_err_vs_exact=lse_error(lse_k, exact_lse),
    )
    if with_xla and name in SPARSE_MLA_XLA_SHAPES:
        plain = jax.jit(lambda q, kv, i: xla_sparse_mla(q, kv, i, **kw))
        for key, f in (("jnp", call("xla")), ("xla", plain)):
            out_x, lse_x = f(*arg_sets[0])
            t_x = time_calls(f, arg_sets, calls=max(1, calls // 2), samples=samples)
            rel, max_rel = oracle.spec_errors(jnp.asarray(out_k, jnp.float32), jnp.asarray(out_x, jnp.float32))
            row.update({f"{key}_ms": t_x * 1e3, f"{key}_tflops": flops / t_x / 1e12, f"speedup_vs_{key}": t_x / t_k,
                        f"{key}_extra_bytes": extra_memory_bytes(f, *arg_sets[0]), f"rel_err_vs_{key}": rel,
                        f"max_err_vs_{key}_rel_to_max": max_rel, f"lse_err_vs_{key}": lse_error(lse_k, lse_x),
                        f"{key}_lse_err_vs_exact": lse_error(lse_x, exact_lse)})
    return row


# name: ((S, N, H, T, D, d_v), deterministic). The backward at SPEC §4's v32 shapes.
SPARSE_MLA_BWD_SHAPES = {
    "mla-bwd-v32-h128": ((4096, 8192, 128, 2048, 576, 512), False),
    "mla-bwd-v32-h64": ((4096, 8192, 64, 2048, 576, 512), False),
    "mla-bwd-det-v32-h128": ((4096, 8192, 128, 2048, 576, 512), True),
    "mla-bwd-det-v32-h64": ((4096, 8192, 64, 2048, 576, 512), True),
}
#: The backward shapes with XLA rows (the plain forward's autodiff, and the jnp path's own backward).
SPARSE_MLA_BWD_XLA_SHAPES = ("mla-bwd-v32-h128",)


def sparse_mla_bwd_flops(S, H, T, D, d_v, B=1) -> int:
    """The backward's GEMMs over every slot: S = QK^T (D), dP = dO V^T (d_v),
    dQ = dS K (D), dK = dS^T Q (D) and dV = P^T dO (d_v)."""
    return 2 * B * S * H * T * (3 * D + 2 * d_v)


def forward_and_backward(forward):
    """jit of ``(q, kv, i, dout, dlse) -> ((out, lse), (dq, dkv))``: the
    forward's outputs returned beside the gradients, so that XLA cannot drop
    forward work the gradient does not need (a rematerialised forward would
    otherwise be timed as its backward less its forward)."""
    def fwd_bwd(q, kv, i, dout, dlse):
        out, vjp = jax.vjp(lambda q, kv: forward(q, kv, i), q, kv)
        return out, vjp((dout, dlse))

    return jax.jit(fwd_bwd)


def bench_sparse_mla_bwd(name, spec, *, calls, samples, gemm_tflops, with_xla=True, implementation="cuda"):
    """One row: the forward plus backward (jax.vjp with cotangents on out and
    lse; :func:`forward_and_backward`) and the forward alone, both timed;
    the backward's time is their difference."""
    import jax_attn_dist
    from jax_attn_dist import oracle

    (S, N, H, T, D, d_v), deterministic = spec
    sets = [sparse_mla_problem(S, N, H, T, D, d_v, seed) for seed in (0, 1)]
    rule = sets[0][1]  # sparse_mla's keywords but deterministic (which the plain XLA has no use for)
    kw = dict(rule, deterministic=deterministic)
    rng = np.random.default_rng(0)
    cot = (jnp.asarray(rng.standard_normal((S, H, d_v)).astype(np.float32), jnp.bfloat16),
           jnp.asarray(rng.standard_normal((S, H)).astype(np.float32)))
    arg_sets = [a + cot for a, _, _ in sets]
    flops = sparse_mla_bwd_flops(S, H, T, D, d_v)

    def package(impl):
        return lambda q, kv, i: jax_attn_dist.sparse_mla(q, kv, i, implementation=impl, **kw)

    def timed(forward, n_calls):
        both, alone = forward_and_backward(forward), jax.jit(lambda q, kv, i, dout, dlse: forward(q, kv, i))
        _, grads = both(*arg_sets[0])
        t_both = time_calls(both, arg_sets, calls=n_calls, samples=samples)
        t_fwd = time_calls(alone, arg_sets, calls=n_calls, samples=samples)
        return grads, t_both, t_fwd, extra_memory_bytes(both, *arg_sets[0])

    row = {"name": name, "kind": "sparse_mla_bwd", "S": S, "N": N, "H": H, "T": T, "D": D, "d_v": d_v,
           "deterministic": deterministic, "flops": flops}
    (dq, dkv), t_both, t_fwd, extra = timed(package(implementation), calls)
    t_k = t_both - t_fwd
    row.update(
        kernel_ms=t_k * 1e3,
        kernel_fwd_bwd_ms=t_both * 1e3,
        kernel_fwd_ms=t_fwd * 1e3,
        kernel_tflops=flops / t_k / 1e12,
        kernel_frac_gemm=flops / t_k / 1e12 / gemm_tflops,
        gemm_floor_ms=flops / (gemm_tflops * 1e12) * 1e3,
        kernel_extra_bytes=extra,
    )
    if with_xla and name in SPARSE_MLA_BWD_XLA_SHAPES:
        def plain(remat):
            return lambda q, kv, i: xla_sparse_mla(q, kv, i, **rule, remat=remat)

        for key, forward in (("jnp", package("xla")), ("xla", plain(True)), ("xla_saved", plain(False))):
            (xdq, xdkv), x_both, x_fwd, x_extra = timed(forward, max(1, calls // 2))
            t_x = x_both - x_fwd
            dq_rel, _ = oracle.spec_errors(jnp.asarray(dq, jnp.float32), jnp.asarray(xdq, jnp.float32))
            dkv_rel, _ = oracle.spec_errors(jnp.asarray(dkv, jnp.float32), jnp.asarray(xdkv, jnp.float32))
            row.update({f"{key}_ms": t_x * 1e3, f"{key}_fwd_bwd_ms": x_both * 1e3, f"{key}_tflops": flops / t_x / 1e12,
                        f"speedup_vs_{key}": t_x / t_k, f"{key}_extra_bytes": x_extra,
                        f"dq_rel_err_vs_{key}": dq_rel, f"dkv_rel_err_vs_{key}": dkv_rel})
    return row
