"""Run a kernel a few times on one benchmark shape, for ncu.

    ncu --kernel-name regex:"attn_dist_kernel|indexer_fwd_kernel" --launch-skip 2 --launch-count 1 --set full \
        python3 tools/profile_kernel.py v32-h64
    ncu --kernel-name kns=indexer_bwd_kernel ... python3 tools/profile_kernel.py idx-v32 bwd-det

An indexer shape takes a second argument: fwd (default), bwd or bwd-det (the
backward alone, in float32-atomic or deterministic mode). So does a sparse_mla
shape (mla-v32-h128, ...):

    ncu --kernel-name kns=sparse_mla_bwd_kernel ... python3 tools/profile_kernel.py mla-v32-h64 bwd

An indexer_topk shape (topk-v32, topk-v32-fp8, ...) runs the selection kernel:

    ncu --kernel-name regex:indexer_topk ... python3 tools/profile_kernel.py topk-v32
"""

import sys

import jax

sys.path.insert(0, "benchmarks")
import jax_attn_dist  # noqa: E402
from bench import ATTN_SHAPES, INDEXER_SHAPES, SPARSE_MLA_SHAPES, TOPK_SHAPES  # noqa: E402
from indexer_bench import indexer_problem  # noqa: E402
from indexer_topk_bench import shape_call as topk_shape_call  # noqa: E402
from sparse_mla_bench import sparse_mla_problem  # noqa: E402
from jax_attn_dist import synthetic  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "v32-h128"
if name in INDEXER_SHAPES:
    args, kw = indexer_problem(*INDEXER_SHAPES[name], seed=0)
    which = sys.argv[2] if len(sys.argv) > 2 else "fwd"
    if which == "fwd":
        f = jax.jit(lambda *a: jax_attn_dist.indexer_kl(*a, implementation="cuda", **kw))
    else:
        fwd = lambda iq, ik, w: jax_attn_dist.indexer_kl(iq, ik, w, *args[3:], deterministic=which == "bwd-det",  # noqa: E731
                                                         **kw)
        out, vjp = jax.vjp(fwd, *args[:3])
        g = jax.numpy.full(out.shape, 1.0 / out.size, jax.numpy.float32)
        f, args = jax.jit(lambda vjp, g: vjp(g)), (vjp, g)
elif name in SPARSE_MLA_SHAPES:
    args, kw, _ = sparse_mla_problem(*SPARSE_MLA_SHAPES[name], seed=0)
    which = sys.argv[2] if len(sys.argv) > 2 else "fwd"
    if which == "fwd":
        f = jax.jit(lambda *a: jax_attn_dist.sparse_mla(*a, implementation="cuda", **kw))
    else:
        fwd = lambda q, kv: jax_attn_dist.sparse_mla(q, kv, args[2], deterministic=which == "bwd-det",  # noqa: E731
                                                     **kw)
        (out, lse), vjp = jax.vjp(fwd, *args[:2])
        cot = (jax.numpy.ones_like(out), jax.numpy.ones_like(lse))
        f, args = jax.jit(lambda vjp, c: vjp(c)), (vjp, cot)
elif name in TOPK_SHAPES:
    f, args = topk_shape_call(name)
else:
    S, N, H, T, D = ATTN_SHAPES[name]
    p = synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=0)
    args = p.arrays
    f = jax.jit(lambda q, k, i, l: jax_attn_dist.attn_dist(q, k, i, l, implementation="cuda", **p.kwargs))
for _ in range(4):
    jax.block_until_ready(f(*args))
print("done", name)
