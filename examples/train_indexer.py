"""Train a DSA lightning indexer with jax_attn_dist.indexer_loss (DeepSeek-V3.2).

The lightning indexer scores every (query t, key s) pair cheaply,

    I[t, s] = sum_j w[t, j] * ReLU(q_idx[t, j] . k_idx[s])

and the sparse attention attends to each query's top-k keys by I. The indexer
is trained with a KL loss towards the main attention's distribution on those
selected keys (docs/SPEC.md §5): ``indexer_loss`` forms the target from
``attn_dist`` (the probability mass of all heads on each selected key,
L1-normalised, under ``stop_gradient``: the main model is not trained by this
loss) and returns the per-row ``KL(target || softmax(I over the selection))``;
its gradients reach the indexer's q, k and weights.

Here a toy model stands in for the main network: per layer, frozen random
projections make the MLA-form q [B, S, H, D] and k [B, S, 1, D] from the
hidden states, and ``exact_lse_canonical`` stands in for the sparse MLA
forward's log-sum-exp over the selected keys (in real training it comes from
the forward kernel, e.g. FlashMLA, with base e). Only the indexer's
projections are trained, with optax's Adam, in one ``jax.jit`` train step
that runs the layers under ``jax.lax.scan`` with ``jax.checkpoint``. The
target depends on no trained parameter, so the backward pass never reruns
attn_dist (its output is a residual of the forward scan).

On a CPU it runs a tiny problem in seconds. On a GPU with the compiled
extension the main attention is bf16 with D = 576 and HK = 1 and the indexer
bf16 with DI = 64, so both attn_dist and the indexer loss's forward run
their CUDA kernels.

    python examples/train_indexer.py [--steps 20] [--size small|gpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax

try:
    import jax_attn_dist
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax_attn_dist
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.attn_dist.reference import exact_lse_canonical
from jax_attn_dist.ops.indexer import contract as indexer_contract

@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 2
    batch: int = 2
    seq: int = 32          # S = N: the keys are the same tokens (k_stride = 1)
    d_model: int = 32
    heads: int = 4         # H of the main attention
    head_dim: int = 16     # D of the main attention (MLA: 576, kernel on GPU)
    topk: int = 8          # T
    idx_heads: int = 4     # indexer heads
    idx_dim: int = 16      # indexer head dim
    dtype: str = "float32"  # main attention q/k dtype (bfloat16 for the kernel)
    lr: float = 1e-2

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5  # whatever the forward used


SMALL = Config()
GPU = Config(layers=4, batch=2, seq=2048, d_model=256, heads=128, head_dim=576, topk=256,
             idx_heads=16, idx_dim=64, dtype="bfloat16", lr=3e-3)


def init(key, cfg: Config):
    """(frozen main-model weights, trainable indexer params), stacked over layers."""
    L, d = cfg.layers, cfg.d_model
    ks = jax.random.split(key, 6)
    normal = lambda k, shape, fan_in: jax.random.normal(k, (L,) + shape, jnp.float32) * fan_in ** -0.5
    frozen = dict(
        wq=normal(ks[0], (d, cfg.heads * cfg.head_dim), d),
        wk=normal(ks[1], (d, cfg.head_dim), d),
        wmix=normal(ks[2], (d, d), d),
    )
    params = dict(
        wq_idx=normal(ks[3], (d, cfg.idx_heads * cfg.idx_dim), d),
        wk_idx=normal(ks[4], (d, cfg.idx_dim), d),
        w_idx=normal(ks[5], (d, cfg.idx_heads), d),
    )
    return frozen, params


def indexer_scores(p, x, cfg: Config):
    """I[b, t, s] = sum_j w[t, j] ReLU(q_idx[t, j] . k_idx[s]) (float32)."""
    B, S, _ = x.shape
    q_idx = (x @ p["wq_idx"]).reshape(B, S, cfg.idx_heads, cfg.idx_dim)
    k_idx = x @ p["wk_idx"]
    w = (x @ p["w_idx"]) * (cfg.idx_heads * cfg.idx_dim) ** -0.5
    return jnp.einsum("bsj,bsjt->bst", w, jax.nn.relu(jnp.einsum("bsjd,btd->bsjt", q_idx, k_idx)))


def layer_loss(p, f, x, cfg: Config):
    """The indexer KL loss of one layer, and the next layer's hidden states."""
    B, S, _ = x.shape
    T, dt = cfg.topk, jnp.dtype(cfg.dtype)

    # top-k selection by the indexer (causal: key s <= query t); -1 pads rows
    # that see fewer than T keys, as a top-k selector would
    scores = indexer_scores(jax.lax.stop_gradient(p), x, cfg)
    causal = jnp.arange(S)[None, :, None] >= jnp.arange(S)[None, None, :]
    top, idx = jax.lax.top_k(jnp.where(causal, scores, -jnp.inf), T)
    idx = jnp.where(jnp.isfinite(top), idx, -1).astype(jnp.int32)[:, :, None, :]  # [B, S, 1, T]

    # the main attention (frozen) and its sparse forward's LSE over the selection
    q = (x @ f["wq"]).reshape(B, S, cfg.heads, cfg.head_dim).astype(dt)
    k = (x @ f["wk"]).reshape(B, S, 1, cfg.head_dim).astype(dt)
    q_start = jnp.zeros((B,), jnp.int32)
    lse = exact_lse_canonical(q, k, idx, q_start, sm_scale=cfg.sm_scale, causal=True, k_stride=1, lse_base="e")

    # the indexer's inputs (trained), and the loss: KL(attn_dist target || softmax(indexer logits))
    index_q = (x @ p["wq_idx"]).reshape(B, S, cfg.idx_heads, cfg.idx_dim).astype(dt)
    index_k = (x @ p["wk_idx"]).astype(dt)
    weights = (x @ p["w_idx"]) * (cfg.idx_heads * cfg.idx_dim) ** -0.5
    kl = jax_attn_dist.indexer_loss(q, k, lse, index_q, index_k, weights, idx, sm_scale=cfg.sm_scale,
                                    lse_base="e", causal=True)  # [B, S]

    x_next = x + jnp.tanh(x @ f["wmix"])
    return kl.mean(), x_next


def total_loss(params, frozen, x0, cfg: Config):
    """Sum over layers of the indexer loss: lax.scan over the stacked layers,
    each layer under jax.checkpoint (its activations recomputed in the backward)."""

    def body(x, layer):
        p, f = layer
        loss, x = layer_loss(p, f, x, cfg)
        return x, loss

    body = jax.checkpoint(body)
    _, losses = jax.lax.scan(body, x0, (params, frozen))
    return losses.sum()


def make_train_step(cfg: Config, optimizer):
    @jax.jit
    def train_step(params, opt_state, frozen, x0):
        loss, grads = jax.value_and_grad(total_loss)(params, frozen, x0, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def kernel_paths(cfg: Config):
    """Which of (attn_dist, indexer_kl forward, indexer_kl backward) run a CUDA kernel for this config."""
    B, S, T, dt = cfg.batch, cfg.seq, cfg.topk, jnp.dtype(cfg.dtype)
    spec = lambda *shape, dtype=dt: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    idx = spec(B, S, 1, T, dtype=jnp.int32)
    attn = attn_contract.kernel_supports(attn_contract.check_problem(
        spec(B, S, cfg.heads, cfg.head_dim), spec(B, S, 1, cfg.head_dim), idx, spec(B, S, cfg.heads, dtype=jnp.float32)))
    problem = indexer_contract.check_problem(
        spec(B, S, cfg.idx_heads, cfg.idx_dim), spec(B, S, cfg.idx_dim), spec(B, S, cfg.idx_heads, dtype=jnp.float32),
        idx, spec(B, S, T, dtype=jnp.float32))
    indexer = indexer_contract.kernel_supports(problem)
    backward = indexer_contract.bwd_kernel_supports(problem)
    on_gpu = jax.default_backend() == "gpu" and jax_attn_dist.kernel_available()
    return on_gpu and attn[0], on_gpu and indexer[0], on_gpu and backward[0]


def uses_kernel(cfg: Config) -> bool:
    return all(kernel_paths(cfg))


def train(cfg: Config = SMALL, steps: int = 10, seed: int = 0, log=None):
    """Runs ``steps`` train steps on one fixed batch; returns the losses."""
    key_model, key_x = jax.random.split(jax.random.PRNGKey(seed))
    frozen, params = init(key_model, cfg)
    x0 = jax.random.normal(key_x, (cfg.batch, cfg.seq, cfg.d_model), jnp.float32)
    optimizer = optax.adam(cfg.lr)
    opt_state = optimizer.init(params)
    step = make_train_step(cfg, optimizer)
    losses = []
    for i in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, frozen, x0)
        losses.append(float(loss))
        if log:
            log(f"step {i:3d}  loss {losses[-1]:.5f}  ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", choices=("small", "gpu"), default=None,
                        help="problem size (default: gpu on a GPU with the kernel, else small)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    size = args.size or ("gpu" if uses_kernel(GPU) else "small")
    cfg = GPU if size == "gpu" else SMALL
    print(f"backend {jax.default_backend()}, size {size}: {cfg}")
    attn, indexer, backward = kernel_paths(cfg)
    name = lambda kernel: "CUDA kernel" if kernel else "jnp (XLA)"  # noqa: E731
    print(f"attn_dist: {name(attn)}; indexer_kl forward: {name(indexer)}, backward: {name(backward)}")
    losses = train(cfg, args.steps, args.seed, log=print)
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    main()
