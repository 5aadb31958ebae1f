"""Transformations of attn_dist with the CUDA kernel on the GPU: gradients
(kernel forward, jnp backward) and vmap. GPU only (see conftest.py); XLA
command buffers are package/test_gpu_command_buffers.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn_dist import oracle
from inputs import make_inputs, seed_of
from jax_attn_dist import attn_dist
from jax_attn_dist.ops.attn_dist.contract import FFI_TARGET
from grad_util import assert_grad_close, plain_attn_dist

pytestmark = pytest.mark.gpu

BF16, F32 = jnp.bfloat16, jnp.float32


def kernel_inputs(tag, *, B=2, S=48, H=128, D=576, N=300, T=200, **kw):
    return make_inputs(seed_of("gpu-transforms", tag), B=B, S=S, H=H, D=D, N=N, T=T,
                       q_start_index="batch" if B else None, lse_noise=0.25, **kw)


def poison_lse(lse, seed):
    lse = np.array(lse)
    rng = np.random.default_rng(seed)
    flat = lse.reshape(-1)
    pick = rng.choice(flat.size, size=6, replace=False)
    flat[pick] = np.array([np.inf, -np.inf, np.nan, np.inf, -np.inf, np.nan], np.float32)
    return jnp.asarray(lse)


# ----------------------------------------------------------------------------
# gradients through the kernel path
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("lse_base", ["2", "e"])
def test_kernel_path_gradients_match_reference_path(lse_base):
    """Forward on the kernel, backward in jnp: the gradients equal those of the
    XLA path and of jax.grad of the plain float32 implementation (bf16
    inputs; gradients rounded to bf16 once)."""
    q, k, idx, lse, kw = kernel_inputs(f"grad-{lse_base}", lse_base=lse_base)
    lse = poison_lse(lse, 1)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((2, 2, 48, 200)), F32)

    def loss(fn, q, k, l):  # nonlinear in out: the forward values enter the gradient
        return jnp.sum(w * fn(q, k, idx, l, q_start_index=qs, **kw) ** 2)

    grad = lambda fn: jax.jit(jax.grad(lambda q, k, l: loss(fn, q, k, l), argnums=(0, 1, 2)))
    cuda = lambda *a, **k_: attn_dist(*a, implementation="cuda", **k_)
    xla = lambda *a, **k_: attn_dist(*a, implementation="xla", **k_)

    hlo = grad(cuda).lower(q, k, lse).as_text()
    assert hlo.count(FFI_TARGET) >= 1
    g_cuda = grad(cuda)(q, k, lse)
    g_xla = grad(xla)(q, k, lse)
    g_plain = jax.jit(jax.grad(lambda q, k, l: loss(plain_attn_dist, q, k, l), argnums=(0, 1, 2)))(
        q.astype(F32), k.astype(F32), lse)
    for name, a, b, c in zip(("dq", "dk", "dlse"), g_cuda, g_xla, g_plain):
        assert a.dtype == b.dtype
        rtol = 1e-4 if name == "dlse" else 1e-2
        # T = 200 float32 sums and bf16 rounding; cancellation needs an absolute term
        assert_grad_close(a, b, f"{name} kernel vs xla path", rtol, atol_frac=2e-5)
        assert_grad_close(a, c, f"{name} kernel vs plain jax.grad", rtol, atol_frac=2e-5)
    assert np.all(np.asarray(g_cuda[2])[~np.isfinite(np.asarray(lse))] == 0.0)


# ----------------------------------------------------------------------------
# vmap on the kernel path
# ----------------------------------------------------------------------------


def test_kernel_vmap_equals_loop_bitwise():
    V = 3
    parts = [kernel_inputs(f"vmap-{v}", T=130) for v in range(V)]
    kw = {key: val for key, val in parts[0][4].items() if key != "q_start_index"}
    q, k, idx, lse = (jnp.stack([p[j] for p in parts]) for j in range(4))
    qs = jnp.stack([jnp.asarray(p[4]["q_start_index"], jnp.int32) for p in parts])
    f = lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, implementation="cuda", **kw)

    vm = jax.jit(jax.vmap(f))
    hlo = vm.lower(q, k, idx, lse, qs).as_text()
    assert hlo.count(f"@{FFI_TARGET}(") == 1  # one launch for all V * B problems
    got = np.asarray(vm(q, k, idx, lse, qs))
    for v in range(V):
        want = np.asarray(jax.jit(f)(q[v], k[v], idx[v], lse[v], qs[v]))
        assert np.array_equal(got[v].view(np.uint32), want.view(np.uint32)), f"vmap row {v} differs from the loop"
        oracle.assert_within_spec(got[v], oracle.attn_dist_oracle(q[v], k[v], idx[v], lse[v], q_start_index=qs[v], **kw))

    # nested vmap over unbatched problems (B = 1 each)
    f1 = lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, implementation="cuda", **kw)
    nested = jax.jit(jax.vmap(jax.vmap(f1)))(q, k, idx, lse, qs)
    for v in range(V):
        for b in range(2):
            want = np.asarray(jax.jit(f1)(q[v, b], k[v, b], idx[v, b], lse[v, b], qs[v, b]))
            assert np.array_equal(np.asarray(nested[v, b]).view(np.uint32), want.view(np.uint32))
