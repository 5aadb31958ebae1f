"""jax.export of functions calling attn_dist, for ["cuda", "cpu"] at once.

The CUDA branch holds the custom call to the ``jax_attn_dist_fwd`` FFI target,
which has no JAX compatibility guarantee, so export needs
``DisabledSafetyCheck.custom_call("jax_attn_dist_fwd")`` (and refuses without
it). Runs on a CPU-only machine: the CUDA branch is lowered, not run; the
deserialised function runs on the local default backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jax_attn_dist import oracle
from inputs import make_inputs, seed_of
from jax_attn_dist import attn_dist
from jax_attn_dist.ops.attn_dist.contract import FFI_TARGET

PLATFORMS = ["cuda", "cpu"]
ALLOW_KERNEL = [export.DisabledSafetyCheck.custom_call(FFI_TARGET)]


def problem(B=2):
    # bf16, HK = 1, D = 576: the kernel applies when lowered for CUDA
    q, k, idx, lse, kw = make_inputs(
        seed_of("export", B), B=B, S=12, H=70, D=576, N=40, T=9, q_start_index="batch" if B else None,
        lse_noise=0.2,
    )
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    return (q, k, idx, lse, qs), kw


def custom_calls(exported):
    return exported.mlir_module().count(f"stablehlo.custom_call @{FFI_TARGET}(")


def test_export_without_disabled_check_raises():
    args, kw = problem()
    f = jax.jit(lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw))
    with pytest.raises(ValueError, match=f"(?s)no compatibility guarantees.*{FFI_TARGET}"):
        export.export(f, platforms=PLATFORMS)(*args)


@pytest.mark.parametrize("B", [None, 2])
def test_export_cuda_cpu_serialize_roundtrip(B):
    pytest.importorskip("flatbuffers", reason="Exported.serialize needs the flatbuffers package")
    args, kw = problem(B)
    f = jax.jit(lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw))
    exp = export.export(f, platforms=PLATFORMS, disabled_checks=ALLOW_KERNEL)(*args)
    assert exp.platforms == tuple(PLATFORMS)
    assert custom_calls(exp) == 1  # the CUDA branch uses the kernel

    blob = exp.serialize()
    assert isinstance(blob, (bytes, bytearray)) and len(blob) > 0
    restored = export.deserialize(blob)
    assert restored.platforms == tuple(PLATFORMS)
    assert restored.in_avals == exp.in_avals and restored.out_avals == exp.out_avals

    got = restored.call(*args)
    q, k, idx, lse, qs = args
    oracle.assert_within_spec(got, oracle.attn_dist_oracle(q, k, idx, lse, q_start_index=qs, **kw))
    if jax.default_backend() == "cpu":  # the CPU branch is the same jnp path as a local jit
        np.testing.assert_array_equal(got, f(*args))
    np.testing.assert_array_equal(jax.jit(restored.call)(*args), got)


def test_export_training_gradient():
    """A jit'ed gradient (forward through the kernel on CUDA, jnp backward)
    exports for both platforms and runs on the local one."""
    pytest.importorskip("flatbuffers", reason="Exported.serialize needs the flatbuffers package")
    (q, k, idx, lse, qs), kw = problem(2)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 2, 12, 9)), jnp.float32)

    def loss(q, k, l, i, s):
        return jnp.sum(w * attn_dist(q, k, i, l, q_start_index=s, **kw) ** 2)  # needs the forward

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    exp = export.export(g, platforms=PLATFORMS, disabled_checks=ALLOW_KERNEL)(q, k, lse, idx, qs)
    assert custom_calls(exp) == 1
    got = export.deserialize(exp.serialize()).call(q, k, lse, idx, qs)
    want = g(q, k, lse, idx, qs)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(a, b)
        else:  # dk's scatter-add may round differently run to run on a GPU (bf16 results)
            np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-5 * np.abs(b).max())


def test_export_xla_path_needs_no_disabled_check():
    args, kw = problem()
    f = jax.jit(lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, implementation="xla", **kw))
    exp = export.export(f, platforms=PLATFORMS)(*args)
    assert custom_calls(exp) == 0
    np.testing.assert_allclose(exp.call(*args), f(*args), rtol=1e-6, atol=1e-7)
