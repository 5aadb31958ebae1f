"""indexer_topk's API: input errors naming the argument, the CUDA lowering
(no GPU needed: the kernel's custom call with its operands and attributes,
and where the XLA path is used instead), export for CUDA and CPU at once,
and gradients of functions that use the indices."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from inputs import seed_of
from jax_attn_dist import attn_dist, indexer_kl, indexer_topk, indexer_topk_kernel_supports
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from topk_inputs import FP8, check_selection, make_topk_inputs

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _good(batched=False):
    lead = (2,) if batched else ()
    return dict(index_q=jnp.zeros(lead + (5, 4, 16), BF16), index_k=jnp.zeros(lead + (7, 16), BF16),
                weights=jnp.zeros(lead + (5, 4), F32))


BAD = [
    ("index_q rank", dict(index_q=jnp.zeros((5, 4), BF16)), ValueError, "`index_q` must have rank 3"),
    ("index_k DI", dict(index_k=jnp.zeros((7, 8), BF16)), ValueError, "`index_k` must have shape .*DI = 16"),
    ("index_k dtype", dict(index_k=jnp.zeros((7, 16), F32)), TypeError, "`index_q` and `index_k` must have the same"),
    ("index_q dtype", dict(index_q=jnp.zeros((5, 4, 16), jnp.int8), index_k=jnp.zeros((7, 16), jnp.int8)),
     TypeError, "`index_q` and `index_k` must have dtype bfloat16"),
    ("weights shape", dict(weights=jnp.zeros((5, 3), F32)), ValueError, r"`weights` must have shape \[S, HI\]"),
    ("weights dtype", dict(weights=jnp.zeros((5, 4), F16)), TypeError, "`weights` must have dtype float32 or"),
    ("rank mix", dict(index_k=jnp.zeros((2, 7, 16), BF16)), ValueError, "`index_k` must have rank 2"),
    ("not an array", dict(weights=[[0.0]]), TypeError, "`weights` must be an array"),
    ("fp8 without key scales", dict(index_q=jnp.zeros((5, 4, 16), FP8), index_k=jnp.zeros((7, 16), FP8)),
     TypeError, "`index_k_scale` is required"),
    ("key scale shape", dict(index_k_scale=jnp.ones((6,), F32)), ValueError, r"`index_k_scale` must have shape \[N\] = \[7\]"),
    ("key scale dtype", dict(index_k_scale=jnp.ones((7,), BF16)), TypeError, "`index_k_scale` must have dtype float32"),
    ("key scale rank", dict(index_k_scale=jnp.ones((1, 7), F32)), ValueError, "`index_k_scale` must have rank 1"),
]


@pytest.mark.parametrize("name,change,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, change, exc, msg):
    with pytest.raises(exc, match="indexer_topk: " + msg):
        indexer_topk(**dict(_good(), **change), topk=3)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(topk=0), ValueError, "`topk` must be an int >= 1"),
    (dict(topk=-2), ValueError, "`topk` must be an int >= 1"),
    (dict(topk=2.0), TypeError, "`topk` must be a Python int"),
    (dict(topk=True), TypeError, "`topk` must be a Python int"),
    (dict(topk=3, scale=0.0), ValueError, "`scale` must be a finite positive"),
    (dict(topk=3, scale=float("nan")), ValueError, "`scale` must be a finite positive"),
    (dict(topk=3, k_stride=0), ValueError, "`k_stride` must be an int >= 1"),
    (dict(topk=3, causal=1), TypeError, "`causal` must be a bool"),
    (dict(topk=3, implementation="tpu"), ValueError, "`implementation` must be None"),
    (dict(topk=3, q_start_index=jnp.zeros((3,), jnp.int32)), ValueError, "`q_start_index` must be a scalar"),
    (dict(topk=3, q_start_index=2**31), ValueError, "`q_start_index` must fit in int32"),
    (dict(topk=3, cu_seqlens_q=jnp.asarray([0, 5], jnp.int32)), ValueError, "`cu_seqlens_q` was given without"),
])
def test_bad_parameters(kw, exc, msg):
    with pytest.raises(exc, match="indexer_topk: " + msg):
        indexer_topk(**_good(), **kw)


def test_topk_is_required():
    with pytest.raises(TypeError, match="topk"):
        indexer_topk(**_good())


def test_batched_shapes_must_agree():
    args = _good(batched=True)
    with pytest.raises(ValueError, match=r"indexer_topk: `weights` must have shape \[B, S, HI\] = \[2, 5, 4\]"):
        indexer_topk(**dict(args, weights=jnp.zeros((3, 5, 4), F32)), topk=2)
    with pytest.raises(ValueError, match=r"indexer_topk: `index_k` must have shape \[B, N, DI\].* B = 2"):
        indexer_topk(**dict(args, index_k=jnp.zeros((3, 7, 16), BF16)), topk=2)
    with pytest.raises(ValueError, match=r"indexer_topk: `index_k_scale` must have shape \[B, N\] = \[2, 7\]"):
        indexer_topk(**args, topk=2, index_k_scale=jnp.ones((3, 7), F32))
    with pytest.raises(ValueError, match="indexer_topk: `cu_seqlens_q`/`cu_seqlens_k` are accepted only with unbatched"):
        cu = jnp.asarray([0, 5], jnp.int32)
        indexer_topk(**args, topk=2, cu_seqlens_q=cu, cu_seqlens_k=cu)


# ----------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------


def test_no_gradient_and_grad_through_users():
    """The selection passes no gradient: jax.grad of a function that feeds
    the indices to indexer_kl works w.r.t. every float input, and is exactly
    the gradient with the indices held constant (index_q's own dependence
    through the selection contributes nothing)."""
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-grad"), S=6, HI=4, DI=16, N=12, dtype=F32)
    kw.pop("index_k_scale", None)
    target = jnp.full((6, 4), 0.25, F32)

    def loss(a, b, c):
        idx = indexer_topk(a, b, c, topk=4, **kw)
        return indexer_kl(a, b, c, idx, target, **kw).sum()

    idx = jax.jit(lambda a: indexer_topk(a, ik, w, topk=4, **kw))(iq)
    fixed = lambda a, b, c: indexer_kl(a, b, c, idx, target, **kw).sum()  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(iq, ik, w)
    want = jax.jit(jax.grad(fixed, argnums=(0, 1, 2)))(iq, ik, w)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # directly: zero cotangents for the inputs; forward mode too
    g = jax.jit(jax.grad(lambda a: jnp.sum(indexer_topk(a, ik, w, topk=4, **kw).astype(F32))))(iq)
    assert not np.asarray(g).any()
    tangent = jax.eval_shape(lambda a: jax.jvp(lambda a: indexer_topk(a, ik, w, topk=4, **kw), (a,),
                                               (jnp.ones_like(a),))[1], iq)
    assert tangent.dtype == jax.dtypes.float0 and tangent.shape == (6, 1, 4)


def test_grad_of_attn_dist_on_selected_indices():
    """attn_dist's gradient w.r.t. q with indices chosen by indexer_topk
    from other arrays (the DSA data flow)."""
    rng = np.random.default_rng(seed_of("topk-attn-grad"))
    S, N, H, D = 4, 10, 2, 16
    q = jnp.asarray(rng.standard_normal((S, H, D)), F32)
    k = jnp.asarray(rng.standard_normal((N, 1, D)), F32)
    lse = jnp.full((S, H), 3.0, F32)
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-attn-grad-ix"), S=S, HI=2, DI=8, N=N, dtype=F32, q_start_index=6)

    def f(q, iq):
        idx = indexer_topk(iq, ik, w, topk=3, **kw)
        return attn_dist(q, k, idx, lse, sm_scale=0.25, lse_base="e", q_start_index=6).sum()

    gq, giq = jax.jit(jax.grad(f, argnums=(0, 1)))(q, iq)
    assert np.isfinite(np.asarray(gq)).all() and np.asarray(gq).any() and not np.asarray(giq).any()


# ----------------------------------------------------------------------------
# the CUDA lowering (no GPU needed) and export
# ----------------------------------------------------------------------------


def _lower(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


_CALL = re.compile(rf"stablehlo\.custom_call @{topk_contract.FFI_TARGET}\((.*)")


@pytest.mark.parametrize("batched,wdt,key_scale,dtype",
                         [(True, F32, False, BF16), (False, BF16, True, BF16), (True, F32, True, FP8)])
def test_cuda_lowering_calls_the_kernel(cross_lowering, batched, wdt, key_scale, dtype):
    """One custom call with the handler's operands (index_q, index_k,
    weights f32, index_k_scale f32, q_start, row_ranges), result and
    attributes; the CPU lowering has none. float8 inputs reach the kernel as
    they are."""
    B = 2 if batched else None
    iq, ik, w, kw = make_topk_inputs(0, B=B, S=4, HI=64, DI=128, N=9, weights_dtype=wdt, key_scale=key_scale,
                                     q_start_index="batch" if batched else None, dtype=dtype)
    et = "bf16" if dtype == BF16 else "f8E4M3FN"
    qs = kw.pop("q_start_index")
    f = lambda a, b, c, s: indexer_topk(a, b, c, topk=5, q_start_index=s, **kw)  # noqa: E731
    text = _lower(f, (iq, ik, w, qs), "cuda")
    calls = _CALL.findall(text)
    assert len(calls) == 1, text
    Bc = B or 1
    operands = (f"tensor<{Bc}x4x64x128x{et}>, tensor<{Bc}x9x128x{et}>, tensor<{Bc}x4x64xf32>, tensor<{Bc}x9xf32>, "
                f"tensor<{Bc}xi32>, tensor<{Bc}x4x0xi32>) -> tensor<{Bc}x4x1x5xi32>")
    assert operands in calls[0], calls[0]
    assert re.search(r"scale = [-0-9.e+]+ : f32", calls[0]) and "causal = true" in calls[0]
    assert "k_stride = 1 : i32" in calls[0]
    assert topk_contract.FFI_TARGET not in _lower(f, (iq, ik, w, qs), "cpu")


@pytest.mark.parametrize("HI", [1, 32, 63])
def test_cuda_lowering_serves_fewer_heads_than_the_variant(cross_lowering, HI):
    """The launcher serves HI up to the variant's heads (the weights past HI
    are zero): the kernel is called with the caller's HI."""
    iq, ik, w, kw = make_topk_inputs(0, S=4, HI=HI, DI=128, N=9)
    problem = topk_contract.check_problem(iq, ik, w, kw.get("index_k_scale"))
    assert indexer_topk_kernel_supports(problem) == (True, "supported")
    (call,) = _CALL.findall(_lower(lambda *a: indexer_topk(*a, topk=5, **kw), (iq, ik, w), "cuda"))
    assert f"tensor<1x4x{HI}x128xbf16>" in call, call


def test_kernel_refuses_more_slots_than_it_counts(cross_lowering):
    """topk above 2^30 (the kernels' slot limit): kernel_supports says why
    (given T, or topk where the problem has none, as in the lowering rule),
    the CUDA lowering falls back to the jnp path and "cuda" raises."""
    iq, ik, w, kw = make_topk_inputs(0, S=4, HI=64, DI=128, N=9)
    problem = topk_contract.check_problem(iq, ik, w, kw.get("index_k_scale"))
    for over in (dict(problem=dataclasses.replace(problem, T=2**30 + 1)), dict(problem=problem, topk=2**30 + 1)):
        ok, why = indexer_topk_kernel_supports(**over)
        assert not ok and "at most 2^30 slots" in why, why
    assert indexer_topk_kernel_supports(problem, topk=2**30)[0]
    # Traced only (never run): the XLA path would need a [S, 1, 2^30 + 1] result.
    args = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (iq, ik, w))
    lowered = jax.jit(lambda *a: indexer_topk(*a, topk=2**30 + 1, **kw)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert topk_contract.FFI_TARGET not in lowered
    assert topk_contract.FFI_TARGET in _lower(lambda *a: indexer_topk(*a, topk=5, **kw), (iq, ik, w), "cuda")
    with pytest.raises(ValueError, match="at most 2\\^30 slots"):
        jax.jit(lambda *a: indexer_topk(*a, topk=2**30 + 1, implementation="cuda", **kw)).trace(*args)


def test_cuda_lowering_of_packed_rows(cross_lowering):
    """With cu_seqlens the row ranges [B, S, 3] are the operand and the
    rule is in them (causal = false)."""
    iq, ik, w, kw = make_topk_inputs(0, S=6, HI=64, DI=128, N=9)
    kw.pop("q_start_index")
    cu = jnp.asarray([0, 2, 6], jnp.int32)
    text = _lower(lambda a: indexer_topk(a, ik, w, topk=3, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw), (iq,), "cuda")
    (call,) = _CALL.findall(text)
    assert "tensor<1x6x3xi32>) -> tensor<1x6x1x3xi32>" in call and "causal = false" in call, call


@pytest.mark.parametrize("change", [dict(dtype=F32), dict(dtype=F16), dict(DI=64), dict(HI=65)])
def test_cuda_lowering_uses_xla_where_the_kernel_does_not_apply(cross_lowering, change):
    shape = dict(HI=64, DI=128, dtype=BF16)
    shape.update(change)
    iq, ik, w, kw = make_topk_inputs(0, S=3, N=9, **shape)
    problem = topk_contract.check_problem(iq, ik, w, kw.get("index_k_scale"))
    ok, why = indexer_topk_kernel_supports(problem)
    assert not ok and "indexer_topk CUDA kernel" in why
    f = lambda *a: indexer_topk(*a, topk=4, **kw)  # noqa: E731
    assert topk_contract.FFI_TARGET not in _lower(f, (iq, ik, w), "cuda")
    with pytest.raises((ValueError, RuntimeError), match="implementation='cuda'"):
        _lower(lambda *a: indexer_topk(*a, topk=4, implementation="cuda", **kw), (iq, ik, w), "cuda")


def test_kernel_supports_variants():
    assert topk_contract.KERNEL_VARIANTS == ((128, 64),)
    assert topk_contract.KERNEL_DTYPES == ("bfloat16", "float8_e4m3fn")
    spec = jax.ShapeDtypeStruct
    problem = topk_contract.check_problem(spec((3, 1000, 64, 128), BF16), spec((3, 1, 128), BF16),
                                          spec((3, 1000, 64), BF16))
    assert indexer_topk_kernel_supports(problem) == (True, "supported")


def test_implementation_cuda_lowering_for_cpu_raises(fake_kernel_available):
    iq, ik, w, kw = make_topk_inputs(0, S=3, HI=64, DI=128, N=9)
    with pytest.raises(ValueError, match="needs a CUDA device; lowering for cpu"):
        _lower(lambda *a: indexer_topk(*a, topk=2, implementation="cuda", **kw), (iq, ik, w), "cpu")


def test_export_for_cuda_and_cpu(cross_lowering):
    """One export with both platforms: the CUDA branch holds the kernel's
    custom call (named in disabled_checks), the CPU branch runs here."""
    iq, ik, w, kw = make_topk_inputs(seed_of("topk-export"), S=6, HI=64, DI=128, N=20)
    f = jax.jit(lambda *a: indexer_topk(*a, topk=5, **kw))
    exp = export.export(f, platforms=["cuda", "cpu"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(topk_contract.FFI_TARGET)])(iq, ik, w)
    assert topk_contract.FFI_TARGET in exp.mlir_module()
    pytest.importorskip("flatbuffers", reason="Exported.serialize needs the flatbuffers package")
    back = export.deserialize(exp.serialize())
    got = back.call(iq, ik, w)
    np.testing.assert_array_equal(got, f(iq, ik, w))
    check_selection(got, iq, ik, w, kw, 5)
    with pytest.raises(ValueError, match=topk_contract.FFI_TARGET):
        export.export(f, platforms=["cuda"])(iq, ik, w)
