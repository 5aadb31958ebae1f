"""The whole DSA attention layer's benchmark row (SPEC §10): the forward plus
backward of ``sum(out * g) + mean(indexer_kl)`` w.r.t. q, kv, index_q,
index_k and weights through ``dsa_attention`` on the kernels, against the
same layer in XLA two ways, each with its temporaries: ``xla``, written
plainly (``plain_xla``; the top-k as the package's jnp path
computes it, a chunked einsum and ``lax.top_k``; sparse MLA as
``plain_xla.xla_sparse_mla``; the target and the loss as
``plain_xla.xla_attn_target`` and ``xla_indexer_kl``), and ``jnp``,
``dsa_attention(implementation="xla")``, the package's jnp paths; and the
same work op by op, each timed alone: the top-k, the sparse MLA forward,
its backward (applied to saved residuals), and the indexer loss (the
target plus indexer_kl) forward + backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from plain_xla import xla_attn_target, xla_indexer_kl, xla_sparse_mla
from timing import extra_memory_bytes, log, time_calls

# name: (S, N, H, D, d_v, topk, HI, DI). V3.2's attention (sparse_mla's
# mla-v32-h128 shape) with its indexer (idx-v32), causal, q_start = N - S.
DSA_SHAPES = {
    "dsa-layer-v32": (4096, 8192, 128, 576, 512, 2048, 64, 128),
}
#: The per-op parts, in the layer's order.
PARTS = ("topk", "sparse_mla_fwd", "sparse_mla_bwd", "indexer_loss_fwd_bwd")


def dsa_problem(dims, seed):
    """(q, kv, index_q, index_k, weights, g) drawn on the device: bf16 normal
    q and kv; the indexer's inputs as topk_problem draws them; ``g`` the
    cotangent of ``out``."""
    S, N, H, D, d_v, _, HI, DI = dims
    ks = jax.random.split(jax.random.key(seed + 104729), 6)
    normal = lambda k, shape, scale=1.0: (jax.random.normal(k, shape, jnp.float32) * scale).astype(jnp.bfloat16)  # noqa: E731
    return (normal(ks[0], (S, H, D)), normal(ks[1], (N, 1, D)), normal(ks[2], (S, HI, DI), DI ** -0.25),
            normal(ks[3], (N, DI), DI ** -0.25), jax.random.normal(ks[4], (S, HI), jnp.float32) * HI ** -0.5,
            normal(ks[5], (S, H, d_v)))


def layer_keywords(dims):
    S, N, H, D, d_v, topk, HI, DI = dims
    return dict(sm_scale=D ** -0.5, topk=topk, d_v=d_v, causal=True, q_start_index=max(N - S, 0))


def package_ops(kw, impl):
    """(topk, sparse_mla, indexer loss) through the package on ``impl``."""
    import jax_attn_dist

    rule = dict(causal=kw["causal"], q_start_index=kw["q_start_index"], implementation=impl)
    return (lambda iq, ik, w: jax_attn_dist.indexer_topk(iq, ik, w, topk=kw["topk"], **rule),
            lambda q, kv, i: jax_attn_dist.sparse_mla(q, kv, i, sm_scale=kw["sm_scale"], d_v=kw["d_v"], lse_base="e",
                                                      **rule),
            lambda q, kv, lse, iq, ik, w, i: jax_attn_dist.indexer_loss(q, kv, lse, iq, ik, w, i, sm_scale=kw["sm_scale"],
                                                                        lse_base="e", **rule))


def plain_ops(kw, remat=True):
    """(topk, sparse_mla, indexer loss) written plainly in XLA (the top-k:
    the package's jnp path, already a chunked einsum and ``lax.top_k``;
    ``remat``: sparse MLA's backward recomputes each chunk's forward, or
    keeps its residuals)."""
    rule = dict(causal=kw["causal"], q_start_index=kw["q_start_index"], k_stride=1)
    topk = package_ops(kw, "xla")[0]
    return (topk,
            lambda q, kv, i: xla_sparse_mla(q, kv, i, sm_scale=kw["sm_scale"], d_v=kw["d_v"], lse_base="e", remat=remat,
                                            **rule),
            lambda q, kv, lse, iq, ik, w, i: xla_indexer_kl(
                iq, ik, w, i, xla_attn_target(q, kv, i, lse, sm_scale=kw["sm_scale"], **rule), scale=1.0, **rule))


def _step(layer):
    """jit(value_and_grad) of ``sum(out * g) + mean(kl)`` w.r.t. the five
    inputs, ``layer(q, kv, iq, ik, w) -> (out, kl)``."""
    def loss(q, kv, iq, ik, w, g):
        out, kl = layer(q, kv, iq, ik, w)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)) + jnp.mean(kl)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def layer_step(kw, impl):
    """The training step through ``dsa_attention`` on ``impl``."""
    import jax_attn_dist

    def layer(q, kv, iq, ik, w):
        r = jax_attn_dist.dsa_attention(q, kv, iq, ik, w, implementation=impl, **kw)
        return r.out, r.indexer_kl

    return _step(layer)


def composed_step(ops):
    """The same step composed of ``ops`` (:func:`plain_ops`) as
    dsa_attention composes its own: the top-k and the target under
    ``stop_gradient``."""
    topk, mla, indexer_loss = ops

    def layer(q, kv, iq, ik, w):
        indices = jax.lax.stop_gradient(topk(iq, ik, w))
        out, lse = mla(q, kv, indices)
        return out, indexer_loss(*(jax.lax.stop_gradient(x) for x in (q, kv, lse)), iq, ik, w, indices)

    return _step(layer)


def time_parts(arg_sets, ops, *, calls, samples):
    """Each op of the layer alone (``ops``: :func:`package_ops` or
    :func:`plain_ops`): ``({part: ms}, the first set's indices)``. The ops
    take the layer's own intermediate arrays (indices, lse), computed once
    beforehand."""
    topk, mla_fn, indexer_loss = ops
    topk, mla = jax.jit(topk), jax.jit(mla_fn)

    def loss_step(q, kv, lse, iq, ik, w, i):
        f = lambda iq, ik, w: indexer_loss(q, kv, lse, iq, ik, w, i).mean()  # noqa: E731
        return jax.value_and_grad(f, argnums=(0, 1, 2))(iq, ik, w)

    loss_step = jax.jit(loss_step)
    topk_sets, mla_sets, bwd_sets, loss_sets = [], [], [], []
    for q, kv, iq, ik, w, g in arg_sets:
        indices = topk(iq, ik, w)
        (out, lse), vjp = jax.vjp(lambda q, kv, i=indices: mla_fn(q, kv, i), q, kv)
        topk_sets.append((iq, ik, w))
        mla_sets.append((q, kv, indices))
        bwd_sets.append((vjp, (g, jnp.zeros_like(lse))))
        loss_sets.append((q, kv, lse, iq, ik, w, indices))
    bwd = jax.jit(lambda vjp, cot: vjp(cot))
    timed = {"topk": (topk, topk_sets), "sparse_mla_fwd": (mla, mla_sets), "sparse_mla_bwd": (bwd, bwd_sets),
             "indexer_loss_fwd_bwd": (loss_step, loss_sets)}
    parts = {part: time_calls(f, sets, calls=calls, samples=samples) * 1e3 for part, (f, sets) in timed.items()}
    return parts, mla_sets[0][2]


def parts_line(parts) -> str:
    return ", ".join(f"{p} {parts[p]:.2f}" for p in PARTS) + f" (sum {sum(parts.values()):.2f} ms)"


def bench_dsa_layer(name, dims, *, calls, samples, gemm_tflops, with_xla=True, implementation="cuda"):
    """One row. ``implementation`` is the timed path ("cuda"; the CPU tests
    pass "xla" to run the row's code without a GPU). ``kernel_ms``: the
    layer's forward + backward; ``parts_ms``: the same ops timed alone."""
    del gemm_tflops  # no single FLOP count: the layer mixes four ops
    S, N, H, D, d_v, topk, HI, DI = dims
    kw = layer_keywords(dims)
    arg_sets = [dsa_problem(dims, seed) for seed in (0, 1)]
    row = {"name": name, "kind": "dsa_layer", "S": S, "N": N, "H": H, "D": D, "d_v": d_v, "topk": topk, "HI": HI,
           "DI": DI}

    step = layer_step(kw, implementation)
    loss_k, _ = step(*arg_sets[0])
    t_k = time_calls(step, arg_sets, calls=max(1, calls // 2), samples=samples)
    parts, indices = time_parts(arg_sets, package_ops(kw, implementation), calls=calls, samples=samples)
    row.update(kernel_ms=t_k * 1e3, kernel_extra_bytes=extra_memory_bytes(step, *arg_sets[0]), parts_ms=parts,
               loss=float(loss_k))
    log(f"  {name}: layer forward + backward {t_k * 1e3:.2f} ms; by op: {parts_line(parts)}")
    gb = lambda b: "n/a" if b is None else f"{b / 1e9:.2f} GB"  # noqa: E731
    if with_xla:
        plain, saved = plain_ops(kw), plain_ops(kw, remat=False)
        for key, f, ops in (("xla", composed_step(plain), plain), ("xla_saved", composed_step(saved), saved),
                            ("jnp", layer_step(kw, "xla"), package_ops(kw, "xla"))):
            loss_x, _ = f(*arg_sets[0])
            t_x = time_calls(f, arg_sets, calls=max(1, calls // 4), samples=samples)
            x_parts, x_indices = time_parts(arg_sets, ops, calls=max(1, calls // 4), samples=samples)
            differing = np.any(np.asarray(indices) != np.asarray(x_indices), axis=(-2, -1))
            row.update({f"{key}_ms": t_x * 1e3, f"{key}_extra_bytes": extra_memory_bytes(f, *arg_sets[0]),
                        f"speedup_vs_{key}": t_x / t_k, f"{key}_parts_ms": x_parts, f"loss_{key}": float(loss_x),
                        # the two selections may differ at near-ties of the cut (SPEC §9.3)
                        f"rows_differing_from_{key}": int(differing.sum())})
            log(f"  {name}: {key} forward + backward {t_x * 1e3:.2f} ms ({t_x / t_k:.1f}x), temporaries + outputs "
                f"{gb(row[f'{key}_extra_bytes'])}; by op: {parts_line(x_parts)}")
    log(f"  {name}: temporaries + outputs {gb(row['kernel_extra_bytes'])}")
    return row
