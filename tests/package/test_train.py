"""The indexer training example (examples/train_indexer.py): a jit'ed optax
train step under lax.scan and jax.checkpoint, with attn_dist's target."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_attn_dist import attn_dist_p
from jaxpr_util import iter_eqns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_indexer.py")

_spec = importlib.util.spec_from_file_location("train_indexer", SCRIPT)
ex = importlib.util.module_from_spec(_spec)
sys.modules["train_indexer"] = ex  # dataclasses look the module up
_spec.loader.exec_module(ex)


def count_attn_dist(jaxpr) -> int:
    """attn_dist binds on the primal path. A custom_vjp call also carries its
    forward rule as a jaxpr in newer jax (0.11: a second copy of the same
    computation, not a second execution): params named *fwd*/*bwd* are skipped."""
    return sum(e.primitive is attn_dist_p for e in iter_eqns(jaxpr, skip_fwd_bwd=True))


def test_scan_checkpoint_equals_unrolled_layers():
    """The scanned, checkpointed loss and its gradient equal a plain Python
    loop over the layers."""
    cfg = ex.SMALL
    frozen, params = ex.init(jax.random.PRNGKey(7), cfg)
    x0 = jax.random.normal(jax.random.PRNGKey(8), (cfg.batch, cfg.seq, cfg.d_model))

    def unrolled(params, frozen, x):
        total = 0.0
        for layer in range(cfg.layers):
            pick = lambda t: jax.tree.map(lambda a: a[layer], t)
            loss, x = ex.layer_loss(pick(params), pick(frozen), x, cfg)
            total = total + loss
        return total

    got = jax.jit(jax.value_and_grad(ex.total_loss), static_argnums=3)(params, frozen, x0, cfg)
    want = jax.jit(jax.value_and_grad(unrolled))(params, frozen, x0)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(jnp.abs(b).max()))
    assert float(jnp.abs(jax.tree.leaves(got[1])[0]).max()) > 0


def test_backward_does_not_rerun_attn_dist():
    """The stop_gradient-ed target depends on no trained parameter: the train
    step runs attn_dist once per layer, in the forward scan, even under
    jax.checkpoint."""
    cfg = ex.SMALL
    frozen, params = ex.init(jax.random.PRNGKey(0), cfg)
    x0 = jnp.zeros((cfg.batch, cfg.seq, cfg.d_model))
    opt = optax.adam(cfg.lr)
    step = ex.make_train_step(cfg, opt)
    jaxpr = jax.make_jaxpr(step)(params, opt.init(params), frozen, x0)
    assert count_attn_dist(jaxpr.jaxpr) == 1


def test_example_script_trains():
    """The script runs as a user would run it, and its steps reduce the loss
    (one compile of the train step serves both checks)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the script finds the package itself from a checkout
    r = subprocess.run([sys.executable, SCRIPT, "--steps", "8", "--seed", "3", "--size", "small"],
                       cwd=os.path.dirname(ROOT), capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\S+)", r.stdout, re.M)]
    assert len(losses) == 8, r.stdout
    assert all(np.isfinite(losses)) and losses[0] > 0
    assert losses[-1] < 0.8 * losses[0], losses


def test_gpu_config_traces():
    """The GPU-sized configuration (bf16, D = 576, HK = 1: the kernel's
    domain) traces; shapes only, nothing is computed here."""
    cfg = ex.GPU
    frozen, params = jax.eval_shape(lambda: ex.init(jax.random.PRNGKey(0), cfg))
    opt = optax.adam(cfg.lr)
    opt_state = jax.eval_shape(opt.init, params)
    x0 = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.d_model), jnp.float32)
    _, _, loss = jax.eval_shape(ex.make_train_step(cfg, opt), params, opt_state, frozen, x0)
    assert loss.shape == () and loss.dtype == jnp.float32
