"""Run the kernel a few times on one benchmark shape, for ncu.

    ncu --kernel-name regex:attn_dist --launch-skip 2 --launch-count 1 --set full \
        python3 tools/profile_kernel.py v32-h64
"""

import sys

import jax

sys.path.insert(0, "benchmarks")
import jax_attn_dist  # noqa: E402
from bench import SHAPES  # noqa: E402
from jax_attn_dist import synthetic  # noqa: E402

S, N, H, T, D = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "v32-h128"]
p = synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=0)
f = jax.jit(lambda q, k, i, l: jax_attn_dist.attn_dist(q, k, i, l, implementation="cuda", **p.kwargs))
for _ in range(4):
    jax.block_until_ready(f(*p.arrays))
print("done", S, N, H, T, D)
