"""The indexer loss's benchmark rows (SPEC §7): ``indexer_kl`` on the kernel,
its jnp path and the loss written plainly in XLA, forward and forward +
backward (FLOPs = 2*B*S*HI*T*DI); and ``step-v32``, the whole indexer
training step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_dist_bench import ATTN_SHAPES
from plain_xla import xla_indexer_kl
from timing import extra_memory_bytes, log, time_calls

# name: (S, N, HI, T, DI). SPEC §7 first, then fewer heads.
INDEXER_SHAPES = {
    "idx-v32": (4096, 8192, 64, 2048, 128),
    "idx-v32-128k": (4096, 131072, 64, 2048, 128),
    "idx-h32": (4096, 8192, 32, 2048, 128),
    "idx-h16": (4096, 8192, 16, 2048, 128),
}
STEPS = ("step-v32",)


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

