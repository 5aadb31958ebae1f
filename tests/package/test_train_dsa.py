"""The DSA block training example (examples/train_dsa.py): the script trains
(its losses fall), on one device and sharded over 8 host devices with the
same losses; the V3.2-sized configuration traces and lies in every op's
kernel domain."""

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_dsa.py")

_spec = importlib.util.spec_from_file_location("train_dsa", SCRIPT)
ex = importlib.util.module_from_spec(_spec)
sys.modules["train_dsa"] = ex  # dataclasses look the module up
_spec.loader.exec_module(ex)


def test_example_script_trains_on_one_device_and_on_a_mesh():
    """Both runs at once (one per core); each compiles its train step once."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the script finds the package itself from a checkout
    runs = [subprocess.Popen([sys.executable, SCRIPT, "--size", "tiny", "--steps", "6", *extra],
                             cwd=os.path.dirname(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env) for extra in ((), ("--mesh",))]
    losses = []
    for r in runs:
        out, err = r.communicate(timeout=300)
        assert r.returncode == 0, err[-3000:] + out[-2000:]
        assert "falls" in out.splitlines()[-1], out
        losses.append([float(x) for x in re.findall(r"^step +\d+  loss (\S+)", out, re.M)])
        assert len(losses[-1]) == 6, out
    assert "mesh {'data': 2, 'seq': 4}" in out, out  # the second run: batch and sequence sharded
    assert losses[0][-1] < 0.5 * losses[0][0], losses[0]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)


def test_v32_config_traces_in_the_kernels_domain():
    """V3.2's attention shape (bf16, D = 576, d_v = 512, HI = 64, DI = 128):
    shapes only, nothing is computed here."""
    from jax_attn_dist.ops.indexer import contract as indexer_contract
    from jax_attn_dist.ops.indexer_topk import contract as topk_contract
    from jax_attn_dist.ops.sparse_mla import contract as mla_contract

    cfg = ex.V32
    assert (cfg.seq, cfg.heads, cfg.head_dim, cfg.topk, cfg.idx_heads, cfg.idx_dim) == (4096, 128, 576, 2048, 64, 128)
    params, _ = jax.eval_shape(lambda: ex.init(jax.random.PRNGKey(0), cfg))
    opt = optax.adam(cfg.lr)
    step, _ = ex.make_train_step(cfg, opt)
    x = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.d_model), jnp.float32)
    out = jax.eval_shape(step, params, jax.eval_shape(opt.init, params), x, x)
    assert all(v.shape == () and v.dtype == jnp.float32 for v in out[2:])
    sds = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    B, S, H, D, HI, DI, T = cfg.batch, cfg.seq, cfg.heads, cfg.head_dim, cfg.idx_heads, cfg.idx_dim, cfg.topk
    idx = sds(B, S, 1, T, dt=jnp.int32)
    mla = mla_contract.check_problem(sds(B, S, H, D), sds(B, S, 1, D), idx)
    assert mla_contract.kernel_supports(mla, d_v=cfg.latent)[0]
    index = indexer_contract.check_problem(sds(B, S, HI, DI), sds(B, S, DI), sds(B, S, HI, dt=jnp.float32), idx,
                                           sds(B, S, T, dt=jnp.float32))
    assert indexer_contract.kernel_supports(index)[0] and indexer_contract.bwd_kernel_supports(index)[0]
    assert topk_contract.kernel_supports(topk_contract.check_problem(sds(B, S, HI, DI), sds(B, S, DI),
                                                                     sds(B, S, HI, dt=jnp.float32)))[0]
