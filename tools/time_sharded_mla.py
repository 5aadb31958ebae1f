"""sparse_mla forward + backward at v32-h128 (S 4096, N 8192, H 128, D 576,
T 2048) on one GPU and with S sharded over two, float32 and deterministic,
timed as benchmarks/bench.py times a row (the median of samples of
back-to-back calls, two input sets); checks that the sharded deterministic
q and kv gradients have the one-GPU call's bits (exit status 1 if not).

    python3 tools/time_sharded_mla.py OUT.json     (a machine with 2 SM90 GPUs)
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, "benchmarks")
import jax_attn_dist  # noqa: E402
from bench import git_commit, kernel_build_id  # noqa: E402
from sparse_mla_bench import sparse_mla_problem  # noqa: E402
from timing import time_calls  # noqa: E402

S, N, H, T, D, d_v = 4096, 8192, 128, 2048, 576, 512


def main(path):
    sets = [sparse_mla_problem(S, N, H, T, D, d_v, seed) for seed in (0, 1)]
    rng = np.random.default_rng(0)
    cot = (jnp.asarray(rng.standard_normal((S, H, d_v)).astype(np.float32), jnp.bfloat16),
           jnp.asarray(rng.standard_normal((S, H)).astype(np.float32)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    out, det_grads = {}, {}
    for det in (False, True):
        kw = dict(sets[0][1], deterministic=det)

        def both(q, kv, i, dout, dlse):
            _, vjp = jax.vjp(lambda q, kv: jax_attn_dist.sparse_mla(q, kv, i, implementation="cuda", **kw), q, kv)
            return vjp((dout, dlse))

        def fwd(q, kv, i, dout, dlse):
            return jax_attn_dist.sparse_mla(q, kv, i, implementation="cuda", **kw)

        for where in ("one", "sharded"):
            if where == "one":
                f_both, f_fwd = jax.jit(both), jax.jit(fwd)
                args = [a + cot for a, _, _ in sets]
            else:
                sh = (rows, whole, rows, rows, rows)
                f_both = jax.jit(both, in_shardings=sh, out_shardings=(rows, whole))
                f_fwd = jax.jit(fwd, in_shardings=sh, out_shardings=(rows, rows))
                args = [tuple(jax.device_put(x, s) for x, s in zip(a + cot, sh)) for a, _, _ in sets]
            key = f"{'det' if det else 'f32'}-{where}"
            if det:  # the deterministic gradients, to compare bits
                det_grads[where] = [np.asarray(g) for g in f_both(*args[0])]
            t_both = time_calls(f_both, args, calls=10, samples=15)
            t_fwd = time_calls(f_fwd, args, calls=10, samples=15)
            out[key] = dict(fwd_bwd_ms=t_both * 1e3, fwd_ms=t_fwd * 1e3, bwd_ms=(t_both - t_fwd) * 1e3)
            print(key, {k: round(v, 3) for k, v in out[key].items()}, flush=True)
    equal = {f"det_{name}_bits_equal": a.tobytes() == b.tobytes()
             for name, a, b in zip(("dq", "dkv"), det_grads["one"], det_grads["sharded"])}
    print("deterministic, sharded against one GPU:", equal)
    same = all(equal.values())
    out.update(equal, devices=[d.device_kind for d in jax.devices()[:2]], jax=jax.__version__,
               commit=git_commit(), kernel_build_id=kernel_build_id())
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
