"""indexer_kl's and indexer_loss's API: input errors naming the argument,
the CUDA lowering (no GPU needed: the kernels' custom calls, forward and
backward in both modes, and where the XLA path is used instead), and export
for CUDA and CPU at once."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from inputs import make_indexer_inputs, seed_of
from jax_attn_dist import indexer_kernel_supports, indexer_kl, indexer_loss, synthetic
from jax_attn_dist._core import ext
from jax_attn_dist.ops.indexer import contract as indexer_contract

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


# ----------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------


def _good(batched=False):
    lead = (2,) if batched else ()
    return dict(
        index_q=jnp.zeros(lead + (5, 4, 16), BF16), index_k=jnp.zeros(lead + (7, 16), BF16),
        weights=jnp.zeros(lead + (5, 4), F32), indices=jnp.zeros(lead + (5, 1, 3), jnp.int32),
        target=jnp.zeros(lead + (5, 3), F32),
    )


BAD = [
    ("index_q rank", dict(index_q=jnp.zeros((5, 4), BF16)), ValueError, "`index_q` must have rank 3"),
    ("index_k DI", dict(index_k=jnp.zeros((7, 8), BF16)), ValueError, "`index_k` must have shape .*DI = 16"),
    ("index_k dtype", dict(index_k=jnp.zeros((7, 16), F32)), TypeError, "`index_q` and `index_k` must have the same dtype"),
    ("index_q dtype", dict(index_q=jnp.zeros((5, 4, 16), jnp.int8)), TypeError, "`index_q` and `index_k` must have the same dtype"),
    ("weights shape", dict(weights=jnp.zeros((5, 3), F32)), ValueError, r"`weights` must have shape \[S, HI\]"),
    ("weights dtype", dict(weights=jnp.zeros((5, 4), F16)), TypeError, "`weights` must have dtype float32 or"),
    ("indices HK", dict(indices=jnp.zeros((5, 2, 3), jnp.int32)), ValueError, r"`indices` must have shape \[S, 1, T\]"),
    ("indices dtype", dict(indices=jnp.zeros((5, 1, 3), jnp.int64 if jax.config.x64_enabled else jnp.int16)),
     TypeError, "`indices` must have dtype int32"),
    ("target shape", dict(target=jnp.zeros((5, 4), F32)), ValueError, r"`target` must have shape \[S, T\]"),
    ("target dtype", dict(target=jnp.zeros((5, 3), BF16)), TypeError, "`target` must have dtype float32"),
    ("rank mix", dict(index_k=jnp.zeros((2, 7, 16), BF16)), ValueError, "`index_k` must have rank 2"),
    ("not an array", dict(target=[[0.0]]), TypeError, "`target` must be an array"),
]


@pytest.mark.parametrize("name,change,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, change, exc, msg):
    args = dict(_good(), **change)
    with pytest.raises(exc, match="indexer_kl: " + msg):
        indexer_kl(**args)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(scale=0.0), ValueError, "`scale` must be a finite positive"),
    (dict(scale=float("inf")), ValueError, "`scale` must be a finite positive"),
    (dict(scale=jnp.float32(1.0)), TypeError, "`scale` must be a Python float"),
    (dict(k_stride=0), ValueError, "`k_stride` must be an int >= 1"),
    (dict(causal=1), TypeError, "`causal` must be a bool"),
    (dict(deterministic="yes"), TypeError, "`deterministic` must be a bool"),
    (dict(implementation="tpu"), ValueError, "`implementation` must be None"),
    (dict(q_start_index=jnp.zeros((3,), jnp.int32)), ValueError, "`q_start_index` must be a scalar"),
    (dict(q_start_index=2**31), ValueError, "`q_start_index` must fit in int32"),
])
def test_bad_parameters(kw, exc, msg):
    with pytest.raises(exc, match="indexer_kl: " + msg):
        indexer_kl(**_good(), **kw)


def test_batched_shapes_must_agree():
    args = _good(batched=True)
    args["weights"] = jnp.zeros((3, 5, 4), F32)
    with pytest.raises(ValueError, match=r"indexer_kl: `weights` must have shape \[B, S, HI\] = \[2, 5, 4\]"):
        indexer_kl(**args)


def test_indexer_loss_bad_inputs_name_indexer_loss():
    p = synthetic.make_problem(S=4, N=8, H=4, T=3, D=16, seed=0)
    ix = synthetic.make_indexer(p, HI=2, DI=16)
    with pytest.raises(ValueError, match="indexer_loss: `index_k` must have shape"):
        indexer_loss(p.q, p.k, p.lse, ix.index_q, ix.index_k[:, :8], ix.weights, p.indices, lse_base="2", sm_scale=0.1)
    with pytest.raises(ValueError, match="indexer_loss: `scale` must be a finite positive"):
        indexer_loss(p.q, p.k, p.lse, *ix.arrays, p.indices, lse_base="2", sm_scale=0.1, scale=-1.0)
    with pytest.raises(ValueError, match="indexer_loss: `k` must have one kv head"):
        k2 = jnp.concatenate([p.k, p.k], axis=1)
        idx2 = jnp.concatenate([p.indices, p.indices], axis=1)
        indexer_loss(p.q, k2, p.lse, *ix.arrays, idx2, lse_base="2", sm_scale=0.1)


# ----------------------------------------------------------------------------
# the CUDA lowering (no GPU needed) and export
# ----------------------------------------------------------------------------


def _lower(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


_CALL = re.compile(rf"stablehlo\.custom_call @{indexer_contract.FWD_FFI_TARGET}\(")
_BWD_CALL = re.compile(rf"stablehlo\.custom_call @{indexer_contract.BWD_FFI_TARGET}\(")


@pytest.mark.parametrize("HI,DI,wdt", [(64, 128, F32), (1, 64, BF16), (200, 128, F32)])
def test_cuda_lowering_calls_the_kernel(cross_lowering, HI, DI, wdt):
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(0, B=2, S=4, HI=HI, DI=DI, N=9, T=5, weights_dtype=wdt,
                                                  q_start_index="batch")
    qs = kw.pop("q_start_index")
    f = lambda a, b, c, d, e, s: indexer_kl(a, b, c, d, e, q_start_index=s, **kw)  # noqa: E731
    text = _lower(f, (iq, ik, w, idx, tgt, qs), "cuda")
    assert len(_CALL.findall(text)) == 1
    assert re.search(r"scale = [-0-9.e+]+ : f32", text) and "k_stride = " in text
    # with gradients: one forward kernel call, and one backward kernel call
    # where it applies (HI <= 64), else the jnp backward
    g = _lower(jax.grad(lambda a: f(a, ik, w, idx, tgt, qs).sum()), (iq,), "cuda")
    assert len(_CALL.findall(g)) == 1
    assert len(_BWD_CALL.findall(g)) == (1 if HI <= indexer_contract.BWD_KERNEL_MAX_HEADS else 0)
    assert indexer_contract.FWD_FFI_TARGET not in _lower(f, (iq, ik, w, idx, tgt, qs), "cpu")


def test_cuda_lowering_of_the_backward(cross_lowering, fake_kernel_available):
    """The backward kernel's call in both modes: the deterministic attribute
    and its workspace (int64 sums [B, N, DI] + one word, as bytes; none in
    float32 mode), and the f32 d index_k cast to index_k's dtype."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(0, B=2, S=4, HI=16, DI=64, N=9, T=5, weights_dtype=BF16)
    problem = indexer_contract.check_problem(iq, ik, w, idx, tgt)
    assert indexer_contract.bwd_kernel_supports(problem) == (True, "supported")
    assert indexer_contract.bwd_kernel_supports(problem, deterministic=True) == (True, "supported")
    for deterministic, workspace in ((False, 0), (True, 8 * (2 * 9 * 64 + 1))):
        loss = lambda a, b, c: indexer_kl(a, b, c, idx, tgt, deterministic=deterministic, **kw).sum()  # noqa: E731
        text = _lower(jax.grad(loss, argnums=(0, 1, 2)), (iq, ik, w), "cuda")
        assert len(_BWD_CALL.findall(text)) == 1, deterministic
        assert len(_CALL.findall(text)) == 1
        call = text[text.index(f"@{indexer_contract.BWD_FFI_TARGET}("):]
        call = call[:call.index("\n")]
        assert f"deterministic = {str(deterministic).lower()}" in call, call
        assert f"tensor<{workspace}xui8>" in call, call
    # implementation="cuda" binds the forward; the backward still lowers (to its kernel here)
    loss = lambda a: indexer_kl(a, ik, w, idx, tgt, implementation="cuda", **kw).sum()  # noqa: E731
    assert len(_BWD_CALL.findall(_lower(jax.grad(loss), (iq,), "cuda"))) == 1


@pytest.mark.parametrize("change", [dict(dtype=F32), dict(DI=32), dict(HI=300)])
def test_cuda_lowering_uses_xla_where_the_kernel_does_not_apply(cross_lowering, change):
    shape = dict(HI=4, DI=64, dtype=BF16)
    shape.update(change)
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(0, S=3, N=9, T=5, **shape)
    problem = indexer_contract.check_problem(iq, ik, w, idx, tgt)
    assert not indexer_kernel_supports(problem)[0]
    assert indexer_contract.FWD_FFI_TARGET not in _lower(lambda *a: indexer_kl(*a, **kw), (iq, ik, w, idx, tgt), "cuda")
    with pytest.raises((ValueError, RuntimeError), match="implementation='cuda'"):
        _lower(lambda *a: indexer_kl(*a, implementation="cuda", **kw), (iq, ik, w, idx, tgt), "cuda")


def test_implementation_cuda_lowering_for_cpu_raises(monkeypatch):
    monkeypatch.setattr(ext, "_state", ext._State(True, "registered: (fake for tests)"))
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(0, S=3, HI=4, DI=64, N=9, T=5)
    with pytest.raises(ValueError, match="needs a CUDA device; lowering for cpu"):
        _lower(lambda *a: indexer_kl(*a, implementation="cuda", **kw), (iq, ik, w, idx, tgt), "cpu")


def test_export_for_cuda_and_cpu(cross_lowering):
    """One export with both platforms: the CUDA branch holds the kernel's
    custom call (named in disabled_checks), the CPU branch runs here."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-export"), S=6, HI=4, DI=64, N=9, T=5)
    f = jax.jit(lambda *a: indexer_kl(*a, **kw))
    exp = export.export(f, platforms=["cuda", "cpu"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(indexer_contract.FWD_FFI_TARGET)])(
        iq, ik, w, idx, tgt)
    assert indexer_contract.FWD_FFI_TARGET in exp.mlir_module()
    pytest.importorskip("flatbuffers", reason="Exported.serialize needs the flatbuffers package")
    back = export.deserialize(exp.serialize())
    np.testing.assert_allclose(back.call(iq, ik, w, idx, tgt), f(iq, ik, w, idx, tgt), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=indexer_contract.FWD_FFI_TARGET):
        export.export(f, platforms=["cuda"])(iq, ik, w, idx, tgt)
