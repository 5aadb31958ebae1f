"""``python -m jax_attn_dist``: the DSA indexer loss on a synthetic problem.

Builds a seeded random DSA-shaped problem (causal top-k indices, the exact
lse of the main attention over them, indexer inputs), then runs under jit:

1. ``attn_dist``, the main attention's mass on each selected key (the target);
2. ``indexer_loss``, the indexer's KL to that target, forward and backward.

It times both and checks them against the independent float64 NumPy
evaluation of docs/SPEC.md (``jax_attn_dist.oracle``; on large problems on a
slab of the first and the last query rows), plus the row-sum invariant of
``attn_dist``. Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import __version__, oracle, synthetic
from ._core import ext
from .ops.attn_dist import attn_dist
from .ops.attn_dist import contract as attn_contract
from .ops.indexer import contract as indexer_contract
from .ops.indexer import indexer_loss

GPU_DEFAULTS = dict(seq=1024, keys=4096, heads=128, topk=512, dim=576, idx_heads=64, idx_dim=128, repeats=20)
CPU_DEFAULTS = dict(seq=128, keys=1024, heads=128, topk=128, dim=576, idx_heads=64, idx_dim=128, repeats=3)
INVARIANT_TOLERANCE = 1e-3
ORACLE_SLAB = 128  # rows at each end checked against float64 when S is larger than two slabs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_attn_dist",
        description=(
            "Run the DSA indexer loss (attn_dist target + indexer_kl) on a synthetic DeepSeek-Sparse-Attention-"
            "shaped problem (random bf16 q/k, causal top-k indices, exact lse, random indexer), time it and check "
            "it against a float64 NumPy evaluation of docs/SPEC.md. Defaults: S=%(seq)d N=%(keys)d H=%(heads)d "
            "T=%(topk)d D=%(dim)d HI=%(idx_heads)d DI=%(idx_dim)d on a GPU; " % GPU_DEFAULTS
            + "S=%(seq)d N=%(keys)d H=%(heads)d T=%(topk)d D=%(dim)d on CPU." % CPU_DEFAULTS
        ),
    )
    p.add_argument("-S", "--seq", type=int, help="query rows S")
    p.add_argument("-N", "--keys", type=int, help="compressed keys N")
    p.add_argument("--heads", type=int, help="main-attention heads H (groups of 64)")
    p.add_argument("--topk", type=int, help="top-k slots T per query")
    p.add_argument("--dim", type=int, help="main-attention head dim D (the CUDA kernel takes 512 or 576)")
    p.add_argument("--idx-heads", type=int, help="indexer heads HI")
    p.add_argument("--idx-dim", type=int, help="indexer head dim DI (the CUDA kernel takes 64 or 128)")
    p.add_argument("--batch", type=int, default=None, help="batch B (default: unbatched)")
    p.add_argument("--k-stride", type=int, default=1, help="key compression stride (default 1)")
    p.add_argument("--lse-base", choices=["2", "e"], default="e",
                   help="base of the synthetic lse: e (natural log, as FlashMLA and cuDNN write it; default) or 2")
    p.add_argument(
        "--implementation", choices=["auto", "cuda", "xla"], default="auto",
        help="auto: the CUDA kernels where they apply, else XLA (default)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--repeats", type=int, help="timed runs after warm-up (median reported)")
    return p


def _median_ms(fn, args, repeats: int) -> float:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _paths(fn, args):
    """What each step of ``fn`` lowers to: (attn_dist, indexer forward, indexer backward)."""
    text = jax.jit(fn).lower(*args).as_text()
    name = lambda target: "CUDA kernel" if target in text else "jnp (XLA)"  # noqa: E731
    return (name(attn_contract.FFI_TARGET), name(indexer_contract.FWD_FFI_TARGET),
            name(indexer_contract.BWD_FFI_TARGET))


def _slabs(S: int):
    """Row ranges checked against float64: all rows, or the first and last slab."""
    if S <= 2 * ORACLE_SLAB:
        return [(0, S)]
    return [(0, ORACLE_SLAB), (S - ORACLE_SLAB, S)]


def _oracle_check(problem, indexer, out, kl, scale):
    """(attn_dist SPEC §3 errors, indexer_kl SPEC §3.2 error, ok) on the slabs."""
    batched = problem.batched
    add_b = (lambda x: np.asarray(x)) if batched else (lambda x: np.asarray(x)[None])
    q, k, idx, lse = (add_b(x) for x in problem.arrays)
    iq, ik, w = (add_b(x) for x in indexer.arrays)
    out, kl = add_b(out), add_b(kl)
    B, S = q.shape[:2]
    q_start = np.broadcast_to(np.asarray(problem.q_start_index, np.int64), (B,))
    kw = dict(sm_scale=problem.sm_scale, causal=problem.causal, k_stride=problem.k_stride, lse_base=problem.lse_base)
    worst_rel = worst_max = worst_kl = 0.0
    for s0, s1 in _slabs(S):
        rows = slice(s0, s1)
        ref = oracle.attn_dist_oracle(q[:, rows], k, idx[:, rows], lse[:, rows], q_start_index=q_start + s0, **kw)
        rel, mx = oracle.spec_errors(out[:, :, rows], ref)
        mass = ref.sum(axis=1)
        total = mass.sum(axis=-1, keepdims=True)
        target = np.where(total > 0, mass / np.where(total > 0, total, 1.0), 0.0)
        kl_ref = oracle.indexer_kl_oracle(iq[:, rows], ik, w[:, rows], idx[:, rows], target, scale=scale,
                                          causal=problem.causal, q_start_index=q_start + s0,
                                          k_stride=problem.k_stride)
        worst_rel, worst_max = max(worst_rel, rel), max(worst_max, mx)
        worst_kl = max(worst_kl, oracle.indexer_error(kl[:, rows], kl_ref))
    ok = (worst_rel <= oracle.ATTN_DIST_TOLERANCE and worst_max <= oracle.ATTN_DIST_TOLERANCE
          and worst_kl <= oracle.INDEXER_TOLERANCE)
    return worst_rel, worst_max, worst_kl, ok


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    implementation = None if args.implementation == "auto" else args.implementation

    problem = synthetic.make_problem(
        S=args.seq, N=args.keys, H=args.heads, T=args.topk, D=args.dim, B=args.batch,
        k_stride=args.k_stride, lse_base=args.lse_base, seed=args.seed,
    )
    indexer = synthetic.make_indexer(problem, HI=args.idx_heads, DI=args.idx_dim, seed=args.seed)
    scale = 1.0
    kw = problem.kwargs
    q_start = kw.pop("q_start_index")
    rule = dict(implementation=implementation, q_start_index=q_start)

    def target_fn(q, k, indices, lse):
        return attn_dist(q, k, indices, lse, **rule, **kw)

    def loss_fn(q, k, lse, index_q, index_k, weights, indices):
        return indexer_loss(q, k, lse, index_q, index_k, weights, indices, scale=scale, **rule, **kw)

    def loss_and_grads(q, k, lse, index_q, index_k, weights, indices):
        total = lambda iq, ik, w: loss_fn(q, k, lse, iq, ik, w, indices).sum()  # noqa: E731
        return jax.value_and_grad(total, argnums=(0, 1, 2))(index_q, index_k, weights)

    loss_args = (problem.q, problem.k, problem.lse, *indexer.arrays, problem.indices)
    try:
        attn_path, _, _ = _paths(target_fn, problem.arrays)
        _, indexer_path, backward_path = _paths(loss_and_grads, loss_args)
    except (ValueError, RuntimeError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target_jit, loss_jit, grad_jit = jax.jit(target_fn), jax.jit(loss_fn), jax.jit(loss_and_grads)
    out = target_jit(*problem.arrays).block_until_ready()
    kl = loss_jit(*loss_args).block_until_ready()
    _, grads = grad_jit(*loss_args)
    t_attn = _median_ms(target_jit, problem.arrays, args.repeats)
    t_loss = _median_ms(loss_jit, loss_args, args.repeats)
    t_step = _median_ms(grad_jit, loss_args, args.repeats)

    rel, max_rel, kl_err, ok_oracle = _oracle_check(problem, indexer, out, kl, scale)
    inv = synthetic.invariant_error(out, problem.lse)
    ok_inv = inv <= INVARIANT_TOLERANCE
    ok_finite = bool(jnp.isfinite(out).all() and jnp.isfinite(kl).all()
                     and all(bool(jnp.isfinite(g).all()) for g in grads))

    B = args.batch
    shape = (f"B={B} " if B is not None else "") + (
        f"S={args.seq} N={args.keys} H={args.heads} T={args.topk} D={args.dim} HI={args.idx_heads} "
        f"DI={args.idx_dim} k_stride={args.k_stride} lse_base={args.lse_base}"
    )
    device = jax.devices()[0]
    checked = ", ".join(f"{a}..{b - 1}" for a, b in _slabs(args.seq))
    on_kernel = attn_path == "CUDA kernel"
    _, _, status = ext.kernel_status()
    print(f"jax_attn_dist {__version__}, jax {jax.__version__}")
    print(f"ran on:      {device.platform} ({getattr(device, 'device_kind', '')}), "
          + ("the CUDA kernels" if on_kernel else "the jnp paths (XLA)"))
    print(f"kernels:     {status}")
    print(f"path:        attn_dist {attn_path}; indexer_kl forward {indexer_path}, backward {backward_path}")
    print(f"shape:       {shape}")
    rate = f" ({problem.flops / t_attn / 1e9:.1f} TFLOP/s)" if on_kernel else ""
    print(f"time:        attn_dist {t_attn:.3f} ms{rate}; "
          f"indexer_loss forward {t_loss:.3f} ms, forward+backward {t_step:.3f} ms (medians of {args.repeats})")
    print(f"vs float64:  attn_dist rel Frobenius err {rel:.3e}, max err / max|ref| {max_rel:.3e} "
          f"(tol {oracle.ATTN_DIST_TOLERANCE:g}); indexer_loss max err {kl_err:.3e} "
          f"(tol {oracle.INDEXER_TOLERANCE:g}) on rows {checked}  [{'ok' if ok_oracle else 'FAIL'}]")
    print(f"invariant:   max rel row-sum err {inv:.3e}  "
          f"[{'ok' if ok_inv else 'FAIL'}, tol {INVARIANT_TOLERANCE:g}]")
    print(f"loss:        mean KL {float(jnp.mean(kl)):.5f}")
    if not ok_finite:
        print("output:      non-finite values  [FAIL]")
    ok = ok_oracle and ok_inv and ok_finite
    print("result:      " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
