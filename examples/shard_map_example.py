"""attn_dist inside shard_map (context parallelism) and under jit shardings.

Runs on CPU with 8 host devices (set below, before jax is imported) and on
GPUs (every local GPU becomes a device of the mesh; with one GPU the mesh has
one device). From the repository root::

    python examples/shard_map_example.py

Inside ``shard_map`` each shard sees only its own S_local query rows, so the
causal rule needs the absolute position of its first row: pass
``q_start_index + jax.lax.axis_index("sp") * S_local``. Under ``jax.jit`` with
shardings, ``attn_dist`` adds that offset itself.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_attn_dist  # noqa: E402
from jax_attn_dist import synthetic  # noqa: E402


def main():
    devices = np.array(jax.devices())
    n = len(devices)
    mesh = jax.sharding.Mesh(devices, ("sp",))  # one axis: the sequence
    on_gpu = devices[0].platform == "gpu"
    # bf16, D = 576, HK = 1: the CUDA kernel serves each shard on a GPU.
    S, N, H, T, D = (1024, 4096, 128, 512, 576) if on_gpu else (64 * n, 512, 64, 64, 576)
    prob = synthetic.make_problem(S=S, N=N, H=H, T=T, D=D, seed=0, q_start_index=N - S)
    q, k, indices, lse = prob.arrays
    kw = dict(sm_scale=prob.sm_scale, causal=True, k_stride=1, lse_base=prob.lse_base)
    q_start_index = jnp.int32(prob.q_start_index)
    S_local = S // n

    # 1. shard_map: S split over "sp"; each shard passes its own offset.
    @functools.partial(
        jax.shard_map, mesh=mesh,
        in_specs=(P("sp"), P(), P("sp"), P("sp"), P()),  # q, k, indices, lse, q_start
        out_specs=P(None, "sp"),                          # out [G, S, T]: S sharded
    )
    def per_shard(q, k, indices, lse, q_start_index):
        shard_start = q_start_index + jax.lax.axis_index("sp") * S_local
        return jax_attn_dist.attn_dist(q, k, indices, lse, q_start_index=shard_start, **kw)

    out_sm = jax.jit(per_shard)(q, k, indices, lse, q_start_index)

    # 2. jit with shardings: attn_dist partitions itself (per-shard offsets
    # included); no all-gather of q, no all-reduce.
    seq = NamedSharding(mesh, P("sp"))
    rep = NamedSharding(mesh, P())
    jitted = jax.jit(
        lambda q, k, i, l, s: jax_attn_dist.attn_dist(q, k, i, l, q_start_index=s, **kw),
        in_shardings=(seq, rep, seq, seq, rep),
        out_shardings=NamedSharding(mesh, P(None, "sp")),
    )
    out_jit = jitted(q, k, indices, lse, q_start_index)
    hlo = jitted.lower(q, k, indices, lse, q_start_index).compile().as_text()

    # 3. the same call on one device.
    out_one = jax.jit(lambda *a: jax_attn_dist.attn_dist(*a, q_start_index=q_start_index, **kw))(
        q, k, indices, lse)

    a, b, c = (np.asarray(x) for x in (out_sm, out_jit, out_one))
    tol = 0 if on_gpu else 1e-5 * max(1.0, np.abs(c).max())  # the kernels are bitwise per row
    d_sm, d_jit = float(np.max(np.abs(a - c))), float(np.max(np.abs(b - c)))
    gathers, reduces = "all-gather" in hlo, "all-reduce" in hlo
    checks = [
        (f"shard_map   vs one device: max |diff| = {d_sm:.3g} (tol {tol:g})", d_sm <= tol),
        (f"jit sharded vs one device: max |diff| = {d_jit:.3g} (tol {tol:g})", d_jit <= tol),
        (f"no all-gather in the sharded program (found: {gathers})", not gathers),
        (f"no all-reduce in the sharded program (found: {reduces})", not reduces),
    ]
    print(f"{n} x {devices[0].platform}; out {c.shape} (G, S, T); S_local = {S_local}")
    for text, ok in checks:
        print(f"{text}  [{'ok' if ok else 'FAIL'}]")
    print(f"each group row sums to 64 (valid rows): {np.round(c.sum(-1)[0, -4:], 3)}")
    passed = all(ok for _, ok in checks)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
