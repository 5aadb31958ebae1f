"""The jnp paths mean the same thing on every backend: float32 inputs through
``implementation="xla"`` (attn_dist and indexer_kl, forward and gradients)
against the float64 oracle at one float32-level tolerance, on the CPU and,
marked ``gpu``, on the GPU. Every matmul of those paths with a float32
operand pins ``Precision.HIGHEST`` (_core/chunks.py, each op's reference
and backward): were one of them to run in TF32 (10 mantissa bits, the GPU
default for float32 matmuls), these errors would be 1e-4 to 1e-3 instead of
1e-7 to 1e-6 -- a GPU control below shows it on the device itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grad_util import attn_dist_grads_f64, plain_attn_dist
from inputs import make_indexer_inputs, make_inputs, seed_of
from jax_attn_dist import attn_dist, indexer_kl, oracle

F32 = jnp.float32

#: float32-level: ||err|| / ||ref|| and max |err| / max |ref| (SPEC §3.1's two
#: measures) of every output against float64. The float32 paths stay below
#: 2e-6 at these sizes; TF32 q.k products alone give 4e-5 to 1e-3.
F32_TOL = 1e-5


def assert_float32_close(got, want, name):
    rel, mx = oracle.spec_errors(np.asarray(jnp.asarray(got, F32)), want)
    assert np.isfinite(np.asarray(got)).all(), f"{name}: non-finite values"
    assert np.abs(np.asarray(want)).max() > 0, f"{name}: the reference is all 0 (degenerate test)"
    assert rel <= F32_TOL and mx <= F32_TOL, f"{name}: rel {rel:.2e}, max {mx:.2e} (float32 tolerance {F32_TOL:g})"


def attn_dist_problem():
    """Two 64-head groups (H = 80), D = 128, invalid and causally invisible
    slots, per-batch q_start, exact lse; and an output cotangent."""
    q, k, idx, lse, kw = make_inputs(seed_of("xla-precision", "attn_dist"), B=2, S=24, H=80, D=128, N=50, T=40,
                                     dtype=F32, q_start_index="batch")
    cot = np.random.default_rng(seed_of("xla-precision", "attn_dist-cot")).standard_normal((2, 2, 24, 40))
    return (q, k, idx, lse), kw, jnp.asarray(cot, F32)


def indexer_problem():
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("xla-precision", "indexer"), B=2, S=24, HI=16, DI=128,
                                                  N=50, T=40, dtype=F32, q_start_index="batch")
    g = np.random.default_rng(seed_of("xla-precision", "indexer-g")).standard_normal((2, 24))
    return (iq, ik, w, idx, tgt), kw, jnp.asarray(g, F32)


def check_xla_paths_in_float32(device):
    """attn_dist and indexer_kl (implementation="xla"), forward and
    gradients, computed on ``device``, against float64 at F32_TOL."""
    put = lambda xs: [jax.device_put(x, device) for x in xs]  # noqa: E731

    (q, k, idx, lse), kw, cot = attn_dist_problem()
    qs = kw.pop("q_start_index")

    def attn(q, k, l, i, s):
        return attn_dist(q, k, i, l, q_start_index=s, implementation="xla", **kw)

    args = put((q, k, lse, idx, jnp.asarray(qs), cot))
    out = jax.jit(attn)(*args[:5])
    assert out.devices() == {device}
    assert_float32_close(out, oracle.attn_dist_oracle(q, k, idx, lse, q_start_index=qs, **kw), "attn_dist")
    grads = jax.jit(lambda q, k, l, i, s, c: jax.vjp(lambda q, k, l: attn(q, k, l, i, s), q, k, l)[1](c))(*args)
    want, _ = attn_dist_grads_f64(q, k, idx, lse, cot, q_start_index=qs, **kw)
    for name, a, b in zip(("dq", "dk", "dlse"), grads, want):
        assert_float32_close(a, b, f"attn_dist {name}")

    (iq, ik, w, idx, tgt), kw, g = indexer_problem()
    qs = kw.pop("q_start_index")

    def kl(a, b, c, i, t, s):
        return indexer_kl(a, b, c, i, t, q_start_index=s, implementation="xla", **kw)

    args = put((iq, ik, w, idx, tgt, jnp.asarray(qs), g))
    assert_float32_close(jax.jit(kl)(*args[:6]),
                         oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, q_start_index=qs, **kw), "indexer_kl")
    grads = jax.jit(jax.grad(lambda a, b, c, i, t, s, g: jnp.sum(g * kl(a, b, c, i, t, s)), argnums=(0, 1, 2)))(*args)
    want = oracle.indexer_grads_oracle(iq, ik, w, idx, tgt, g, q_start_index=qs, **kw)
    for name, a, b in zip(("d_index_q", "d_index_k", "d_weights"), grads, want):
        assert_float32_close(a, b, f"indexer_kl {name}")


def test_xla_paths_in_float32_on_cpu():
    check_xla_paths_in_float32(jax.devices("cpu")[0])


@pytest.mark.gpu
def test_xla_paths_in_float32_on_gpu():
    """The same computations on the GPU, at the same tolerance; and a control:
    the forward with its q.k products in TF32 misses that tolerance there."""
    gpu = jax.devices("cuda")[0]
    check_xla_paths_in_float32(gpu)
    (q, k, idx, lse), kw, _ = attn_dist_problem()
    tf32 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    put = lambda xs: [jax.device_put(x, gpu) for x in xs]  # noqa: E731
    out = jax.jit(lambda q, k, i, l: plain_attn_dist(q, k, i, l, precision=tf32, **kw))(*put((q, k, idx, lse)))
    rel, mx = oracle.spec_errors(np.asarray(out), oracle.attn_dist_oracle(q, k, idx, lse, **kw))
    assert max(rel, mx) > 2 * F32_TOL, f"TF32 products should miss the float32 tolerance: rel {rel:.2e}, max {mx:.2e}"
