"""sparse_mla under jax transformations on the CPU: vmap (folded into the
batch: one primitive, equal to a loop), nested vmap, vmap of the gradient,
and jax.export for ["cuda", "cpu"] (the CUDA branch holds the kernels'
custom calls, which need ``DisabledSafetyCheck.custom_call``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from inputs import seed_of
from jax_attn_dist import sparse_mla, sparse_mla_p
from jax_attn_dist.ops.sparse_mla.contract import BWD_FFI_TARGET, FFI_TARGET
from jaxpr_util import iter_eqns
from sparse_mla_cases import check_against_oracle, check_grads, make_sparse_mla_inputs

F32 = jnp.float32
PLATFORMS = ["cuda", "cpu"]
ALLOW_KERNEL = [export.DisabledSafetyCheck.custom_call(t) for t in (FFI_TARGET, BWD_FFI_TARGET)]


def _same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6, atol=1e-6)


def test_vmap_folds_into_batch_and_equals_loop():
    """vmap over unbatched calls (per-example q_start traced) binds the
    primitive once with B = V, and equals a Python loop."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("vmap"), B=3, S=5, H=2, D=8, N=9, T=4, dtype=F32,
                                            q_start_index="batch")
    qs = kw.pop("q_start_index")
    f = lambda q, kv, i, s: sparse_mla(q, kv, i, q_start_index=s, **kw)  # noqa: E731
    got = jax.jit(jax.vmap(f))(q, kv, idx, qs)
    want = [f(q[b], kv[b], idx[b], qs[b]) for b in range(3)]
    _same(got, tuple(jnp.stack(w) for w in zip(*want)))
    jaxpr = jax.make_jaxpr(jax.vmap(f))(q, kv, idx, qs)
    eqns = [e for e in iter_eqns(jaxpr.jaxpr, skip_fwd_bwd=True) if e.primitive is sparse_mla_p]
    assert len(eqns) == 1 and eqns[0].invars[0].aval.shape[0] == 3


def test_nested_vmap_over_batched_calls_and_shared_kv():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("vmap2"), B=2, S=4, H=2, D=8, N=6, T=3, dtype=F32)
    q2 = jnp.stack([q, q * 0.5])                   # [2, B, S, H, D]
    idx2 = jnp.stack([idx, jnp.flip(idx, -1)])
    f = lambda q, i: sparse_mla(q, kv, i, **kw)     # noqa: E731  (kv shared: not vmapped)
    got = jax.jit(jax.vmap(f))(q2, idx2)
    for v in range(2):
        _same((got[0][v], got[1][v]), f(q2[v], idx2[v]))


def test_vmap_of_grad_equals_loop():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("vmap-grad"), B=2, S=4, H=2, D=8, N=7, T=5, dtype=F32)

    def loss(q, kv, i):
        out, lse = sparse_mla(q, kv, i, **kw)
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(q, kv, idx)
    for b in range(2):
        _same((got[0][b], got[1][b]), g(q[b], kv[b], idx[b]))


def _export_problem():
    # bf16, HK = 1, D = 512, d_v = 512: the kernel applies when lowered for CUDA
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("export"), B=2, S=6, H=3, D=512, N=12, T=5,
                                            q_start_index="batch")
    qs = kw.pop("q_start_index")
    return (q, kv, idx, qs), kw


def test_export_needs_the_disabled_check_and_round_trips(cross_lowering):
    pytest.importorskip("flatbuffers", reason="Exported.serialize needs the flatbuffers package")
    (q, kv, idx, qs), kw = _export_problem()
    f = jax.jit(lambda q, kv, i, s: sparse_mla(q, kv, i, q_start_index=s, **kw))
    with pytest.raises(ValueError, match=f"(?s)no compatibility guarantees.*{FFI_TARGET}"):
        export.export(f, platforms=PLATFORMS)(q, kv, idx, qs)
    exp = export.export(f, platforms=PLATFORMS, disabled_checks=ALLOW_KERNEL)(q, kv, idx, qs)
    assert exp.mlir_module().count(f"stablehlo.custom_call @{FFI_TARGET}(") == 1
    restored = export.deserialize(exp.serialize())
    out, lse = restored.call(q, kv, idx, qs)
    check_against_oracle(q, kv, idx, dict(kw, q_start_index=qs), out, lse, out_tol=2 ** -8, lse_tol=1e-4)
    if jax.default_backend() == "cpu":  # the CPU branch is the local jnp path
        _same((out, lse), f(q, kv, idx, qs))


def test_export_training_gradient(cross_lowering):
    pytest.importorskip("flatbuffers", reason="Exported.serialize needs the flatbuffers package")
    (q, kv, idx, qs), kw = _export_problem()

    def loss(q, kv, i, s):
        out, lse = sparse_mla(q, kv, i, q_start_index=s, **kw)
        return jnp.sum(out.astype(F32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    exp = export.export(g, platforms=PLATFORMS, disabled_checks=ALLOW_KERNEL)(q, kv, idx, qs)
    assert exp.mlir_module().count(f"stablehlo.custom_call @{FFI_TARGET}(") == 1
    assert exp.mlir_module().count(f"stablehlo.custom_call @{BWD_FFI_TARGET}(") == 1
    got = export.deserialize(exp.serialize()).call(q, kv, idx, qs)
    want = g(q, kv, idx, qs)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # on every backend: the float64 gradients of the loss (SPEC §8.3's limits,
    # check_grads) at the cotangents it gives, dout = 2 out (rounded to out's
    # dtype, as the traced cotangent is) and dlse = 1 where lse is finite
    out, lse = jax.jit(lambda q, kv, i, s: sparse_mla(q, kv, i, q_start_index=s, **kw))(q, kv, idx, qs)
    dout = (2.0 * out.astype(F32)).astype(out.dtype)
    dlse = jnp.where(jnp.isfinite(lse), 1.0, 0.0).astype(F32)
    assert not np.asarray(jnp.isfinite(lse)).all() and np.asarray(jnp.isfinite(lse)).any()
    check_grads(q, kv, idx, dict(kw, q_start_index=qs), dout, dlse, *got)


def test_export_xla_path_needs_no_disabled_check():
    (q, kv, idx, qs), kw = _export_problem()
    f = jax.jit(lambda q, kv, i, s: sparse_mla(q, kv, i, q_start_index=s, implementation="xla", **kw))
    exp = export.export(f, platforms=PLATFORMS)(q, kv, idx, qs)
    assert f"@{FFI_TARGET}" not in exp.mlir_module()
    _same(exp.call(q, kv, idx, qs), f(q, kv, idx, qs))
