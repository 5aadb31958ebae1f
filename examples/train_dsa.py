"""Train a small DeepSeek Sparse Attention block with jax_attn_dist.dsa_attention.

One call computes the whole DSA attention layer (DeepSeek-V3.2): the
lightning indexer picks each query's top-k keys, sparse MLA attends to them,
and the indexer's KL loss pulls its scores towards the attention's own mass
on those keys (docs/SPEC.md §10). Its gradients are routed as DSA trains:
the attention output trains the attention's projections, the KL trains the
indexer's, and the top-k selection has none.

The block, MLA-style (the absorbed form, as the sparse MLA kernels take it)::

    kv      = [x W_dkv | rope(x W_kr)]            [B, S, 1, 576]  shared latent: 512 values + 64 rope
    q       = [x W_q   | rope(x W_qr)]            [B, S, H, 576]
    index_q = x W_iq,  index_k = x W_ik           [B, S, HI, DI], [B, S, DI]
    weights = x W_w / sqrt(HI)                    [B, S, HI]
    out, kl = dsa_attention(q, kv, index_q, index_k, weights, topk=...)
    y_hat   = out W_o                             [B, S, d_model]

It is trained with optax's Adam on a fixed batch to regress a target that
needs attention (a fixed random map of the previous token's features), plus
the mean KL. The script prints the losses per step and exits non-zero if
they do not fall.

    python examples/train_dsa.py [--size tiny|v32] [--steps 8] [--mesh]

``--size tiny`` (the default without a Hopper GPU) runs in seconds on a CPU
through the jnp paths; ``--size v32`` (the default with one) is V3.2's
attention shape, S = 4096, H = 128, D = 576, topk = 2048, HI = 64, DI = 128,
in bf16 through the CUDA kernels. ``--mesh`` shards the batch and the
sequence over every device present (on a CPU: 8 host devices).
"""

from __future__ import annotations

import os
import sys

if "--mesh" in sys.argv:  # host devices for a CPU mesh; read when jax starts its CPU backend
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}=8".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

try:
    import jax_attn_dist
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax_attn_dist


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 2
    seq: int = 64           # S = N: the keys are the same tokens
    d_model: int = 64
    heads: int = 4          # H
    latent: int = 48        # MLA's kv latent (V3.2: 512), the values: d_v
    rope: int = 16          # rotary part of q and kv (V3.2: 64); D = latent + rope
    topk: int = 16
    idx_heads: int = 4      # HI
    idx_dim: int = 32       # DI
    dtype: str = "float32"  # q, kv and the indexer's inputs (bfloat16 for the kernels)
    lr: float = 3e-3

    @property
    def head_dim(self) -> int:
        return self.latent + self.rope

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5


TINY = Config()
V32 = Config(batch=1, seq=4096, d_model=1024, heads=128, latent=512, rope=64, topk=2048, idx_heads=64, idx_dim=128,
             dtype="bfloat16", lr=1e-3)
SIZES = {"tiny": TINY, "v32": V32}


def init(key, cfg: Config):
    """The block's parameters (float32), and the fixed map the target is made with."""
    d, H = cfg.d_model, cfg.heads
    shapes = dict(w_dkv=(d, cfg.latent), w_kr=(d, cfg.rope), w_q=(d, H * cfg.latent), w_qr=(d, H * cfg.rope),
                  w_iq=(d, cfg.idx_heads * cfg.idx_dim), w_ik=(d, cfg.idx_dim), w_w=(d, cfg.idx_heads),
                  w_o=(H * cfg.latent, d))
    keys = jax.random.split(key, len(shapes) + 1)
    params = {name: jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5
              for k, (name, shape) in zip(keys, shapes.items())}
    teacher = jax.random.normal(keys[-1], (d, d), jnp.float32) * d ** -0.5
    return params, teacher


def rope(x, positions):
    """Rotary position embedding over the last axis (x [B, S, ..., R])."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq                       # [S, R/2]
    angle = angle.reshape((1, x.shape[1]) + (1,) * (x.ndim - 3) + (half,))
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def block(params, x, cfg: Config):
    """The DSA attention block: (prediction [B, S, d_model], kl [B, S])."""
    B, S, _ = x.shape
    H, dt = cfg.heads, jnp.dtype(cfg.dtype)
    xc = x.astype(dt)
    mm = lambda name: xc @ params[name].astype(dt)  # noqa: E731  (products in the attention's dtype)
    pos = jnp.arange(S)
    kv = jnp.concatenate([mm("w_dkv"), rope(mm("w_kr"), pos).astype(dt)], axis=-1)[:, :, None, :]
    q = jnp.concatenate([mm("w_q").reshape(B, S, H, cfg.latent),
                         rope(mm("w_qr").reshape(B, S, H, cfg.rope), pos).astype(dt)], axis=-1)
    index_q = mm("w_iq").reshape(B, S, cfg.idx_heads, cfg.idx_dim)
    index_k = mm("w_ik")
    weights = (x @ params["w_w"]) * cfg.idx_heads ** -0.5
    r = jax_attn_dist.dsa_attention(q, kv, index_q, index_k, weights, sm_scale=cfg.sm_scale, topk=cfg.topk,
                                    d_v=cfg.latent, causal=True)
    y_hat = r.out.reshape(B, S, H * cfg.latent).astype(jnp.float32) @ params["w_o"]
    return y_hat, r.indexer_kl


def target_of(x, teacher):
    """What the block learns to predict: the previous token's features
    through a fixed random map (the first token: zeros)."""
    prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
    return jnp.tanh(prev @ teacher)


def loss_fn(params, x, y, cfg: Config):
    y_hat, kl = block(params, x, cfg)
    main = jnp.mean((y_hat - y) ** 2)
    kl = jnp.mean(kl)
    return main + kl, (main, kl)


def shardings(cfg: Config, use_mesh: bool):
    """(params sharding, batch sharding) or (None, None) without a mesh."""
    if not use_mesh:
        return None, None
    devices = np.array(jax.devices())
    data = math.gcd(cfg.batch, len(devices))
    mesh = jax.sharding.Mesh(devices.reshape(data, len(devices) // data), ("data", "seq"))
    if cfg.seq % mesh.shape["seq"]:
        raise SystemExit(f"--mesh: the sequence ({cfg.seq}) must divide over {mesh.shape['seq']} devices")
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data", "seq"))


def make_train_step(cfg: Config, optimizer, use_mesh: bool = False):
    replicated, batch = shardings(cfg, use_mesh)

    def train_step(params, opt_state, x, y):
        (loss, (main, kl)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, main, kl

    if not use_mesh:
        return jax.jit(train_step), None
    return jax.jit(train_step, in_shardings=(replicated, replicated, batch, batch),
                   out_shardings=(replicated, replicated, replicated, replicated, replicated)), (replicated, batch)


def train(cfg: Config, steps: int, seed: int = 0, use_mesh: bool = False, log=print):
    """Runs ``steps`` train steps on one fixed batch; returns the total losses."""
    key_model, key_x = jax.random.split(jax.random.PRNGKey(seed))
    params, teacher = init(key_model, cfg)
    x = jax.random.normal(key_x, (cfg.batch, cfg.seq, cfg.d_model), jnp.float32)
    y = target_of(x, teacher)
    optimizer = optax.adam(cfg.lr)
    step, placement = make_train_step(cfg, optimizer, use_mesh)
    if placement is not None:
        replicated, batch = placement
        params = jax.device_put(params, replicated)
        x, y = jax.device_put(x, batch), jax.device_put(y, batch)
        log(f"mesh {dict(batch.mesh.shape)}: x {batch.spec}, params replicated")
    opt_state = optimizer.init(params)
    if placement is not None:  # placed as the step returns it: one compile
        opt_state = jax.device_put(opt_state, placement[0])
    losses = []
    for i in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss, main, kl = step(params, opt_state, x, y)
        losses.append(float(loss))
        log(f"step {i:3d}  loss {losses[-1]:.5f}  (regression {float(main):.5f}, indexer kl {float(kl):.5f})  "
            f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
    return losses


def kernel_ready(cfg: Config) -> bool:
    """Whether this config runs every op's CUDA kernel here."""
    return (jax.default_backend() == "gpu" and jax_attn_dist.kernel_available() and cfg.dtype == "bfloat16"
            and cfg.head_dim == 576 and cfg.latent == 512 and (cfg.idx_heads, cfg.idx_dim) == (64, 128))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default=None,
                        help="problem size (default: v32 on a GPU with the kernels, else tiny)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mesh", action="store_true", help="shard batch and sequence over every device")
    args = parser.parse_args(argv)
    size = args.size or ("v32" if kernel_ready(V32) else "tiny")
    cfg = SIZES[size]
    print(f"backend {jax.default_backend()} ({len(jax.devices())} devices), size {size}: {cfg}")
    print(f"paths: {'the CUDA kernels' if kernel_ready(cfg) else 'jnp (XLA)'}")
    losses = train(cfg, args.steps, args.seed, use_mesh=args.mesh)
    fell = len(losses) >= 2 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}: {'falls' if fell else 'DOES NOT FALL'}")
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
