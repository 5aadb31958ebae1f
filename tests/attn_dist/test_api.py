"""Shapes, tracing, lowering, implementation selection and input errors (CPU)."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn_dist import attn_dist, attn_dist_p, attn_dist_reference, kernel_supports
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist._core import ext
from jax_attn_dist._core import primitives
from jax_attn_dist.ops.attn_dist.contract import FFI_TARGET
from jax_attn_dist.ops.attn_dist.contract import Problem
from jaxpr_util import iter_eqns

BF16 = jnp.bfloat16
SDS = jax.ShapeDtypeStruct

# Every test here lowers for CUDA as a CPU-only process does (conftest).
pytestmark = pytest.mark.usefixtures("cross_lowering")


def specs(B=None, S=5, H=3, D=576, N=7, HK=1, T=4, dtype=BF16):
    lead = (B,) if B is not None else ()
    return (
        SDS(lead + (S, H, D), dtype),
        SDS(lead + (N, HK, D), dtype),
        SDS(lead + (S, HK, T), jnp.int32),
        SDS(lead + (S, H), jnp.float32),
    )


def zeros_like_specs(s):
    return tuple(jnp.zeros(x.shape, x.dtype) for x in s)


# ----------------------------------------------------------------------------
# shapes without compiling
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [attn_dist, attn_dist_reference], ids=["attn_dist", "reference"])
@pytest.mark.parametrize("B,H,G", [(None, 3, 1), (None, 64, 1), (2, 65, 2), (3, 128, 2), (1, 192, 3)])
def test_eval_shape(fn, B, H, G):
    out = jax.eval_shape(lambda *a: fn(*a, sm_scale=0.1, lse_base="2"), *specs(B=B, H=H))
    lead = (B,) if B is not None else ()
    assert out.shape == lead + (G, 5, 4) and out.dtype == jnp.float32


def test_eval_shape_benchmark_size_is_fast():
    """Tracing the largest SPEC §4 shape allocates and compiles nothing."""
    s = specs(B=2, S=4096, H=128, D=576, N=131072, T=2048)
    t0 = time.perf_counter()
    for fn in (attn_dist, attn_dist_reference):
        out = jax.eval_shape(lambda *a: fn(*a, sm_scale=0.1, lse_base="2", q_start_index=jnp.zeros((2,), jnp.int32)), *s)
        assert out.shape == (2, 2, 4096, 2048)
    assert time.perf_counter() - t0 < 30


def _attn_dist_eqns(jaxpr):
    """The attn_dist_p equations of a jaxpr, inside sub-jaxprs too (the
    public function binds it inside a custom_vjp)."""
    return [e for e in iter_eqns(jaxpr) if e.primitive is attn_dist_p]


@pytest.mark.parametrize("B", [None, 2])
def test_primitive_abstract_eval(B):
    """The logical primitive sees canonical batched operands and gives [B,G,S,T] f32."""
    jaxpr = jax.make_jaxpr(lambda *a: attn_dist(*a, sm_scale=0.25, k_stride=2, lse_base="e"))(*specs(B=B, H=100))
    eqns = _attn_dist_eqns(jaxpr.jaxpr)
    assert len(eqns) == 1
    e = eqns[0]
    Bc = B or 1
    assert [v.aval.shape for v in e.invars] == [(Bc, 5, 100, 576), (Bc, 7, 1, 576), (Bc, 5, 1, 4), (Bc, 5, 100), (Bc,),
                                                (Bc, 5, 0)]  # row_ranges: none
    assert e.invars[4].aval.dtype == jnp.int32 and e.invars[5].aval.dtype == jnp.int32
    assert e.outvars[0].aval.shape == (Bc, 2, 5, 4)
    assert e.outvars[0].aval.dtype == jnp.float32
    assert e.params == dict(sm_scale=0.25, causal=True, k_stride=2, lse_base="e", implementation=None)
    assert isinstance(e.params["sm_scale"], float) and isinstance(e.params["k_stride"], int)


def test_primitive_rejects_non_canonical_operands():
    q, k, i, l = specs(B=None)
    with pytest.raises(ValueError, match="canonical"):
        jax.eval_shape(
            lambda *a: attn_dist_p.bind(*a, sm_scale=1.0, causal=True, k_stride=1, lse_base="2", implementation=None),
            q, k, i, l, SDS((1,), jnp.int32), SDS((1, 5, 0), jnp.int32),
        )


def test_empty_problem_binds_nothing():
    jaxpr = jax.make_jaxpr(lambda *a: attn_dist(*a, lse_base="2", sm_scale=0.1))(*specs(S=0))
    assert not _attn_dist_eqns(jaxpr.jaxpr)


# ----------------------------------------------------------------------------
# lowering and implementation selection
# ----------------------------------------------------------------------------



_CALL = re.compile(r"stablehlo\.custom_call @jax_attn_dist_fwd\(([^)]*)\)(.*)")


def lower_text(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def custom_calls(text):
    return [m for m in (_CALL.search(line) for line in text.splitlines()) if m]


@pytest.mark.parametrize("B", [None, 3])
@pytest.mark.parametrize("D", attn_contract.KERNEL_HEAD_DIMS)
def test_cuda_lowering_emits_ffi_call(B, D):
    """Lowering for CUDA needs no GPU and no built extension."""
    args = zeros_like_specs(specs(B=B, H=130, D=D))
    qs = jnp.asarray([1, 2, 3][: B or 1] if B else 4, jnp.int32)

    def f(q, k, i, l, s):
        return attn_dist(q, k, i, l, sm_scale=0.1234, causal=False, q_start_index=s, k_stride=4, lse_base="e")

    text = lower_text(f, (*args, qs), "cuda")
    calls = custom_calls(text)
    assert len(calls) == 1, text
    operands, rest = calls[0].group(1), calls[0].group(2)
    assert len(operands.split(",")) == 6
    Bc = B or 1
    sig = (
        f"(tensor<{Bc}x5x130x{D}xbf16>, tensor<{Bc}x7x1x{D}xbf16>, tensor<{Bc}x5x1x4xi32>, "
        f"tensor<{Bc}x5x130xf32>, tensor<{Bc}xi32>, tensor<{Bc}x5x0xi32>) -> tensor<{Bc}x3x5x4xf32>"
    )
    assert sig in rest, rest
    assert re.search(r"sm_scale = 1\.234000e-01 : f32", rest), rest
    assert "k_stride = 4 : i32" in rest
    assert "causal = false" in rest
    assert "lse_base_e = true" in rest


def test_cuda_lowering_default_attributes():
    text = lower_text(lambda *a: attn_dist(*a, lse_base="2", sm_scale=0.5), zeros_like_specs(specs()), "cuda")
    (call,) = custom_calls(text)
    rest = call.group(2)
    assert "causal = true" in rest and "k_stride = 1 : i32" in rest and "lse_base_e = false" in rest
    assert "sm_scale = 5.000000e-01 : f32" in rest


@pytest.mark.parametrize(
    "kw,spec_kw",
    [
        (dict(implementation="xla"), {}),
        ({}, dict(D=128)),  # head dim the kernel does not take
        ({}, dict(dtype=jnp.float16)),
        ({}, dict(dtype=jnp.float32)),
        ({}, dict(H=4, HK=2)),
    ],
    ids=["xla", "D128", "f16", "f32", "HK2"],
)
def test_cuda_lowering_falls_back_to_reference(kw, spec_kw):
    text = lower_text(lambda *a: attn_dist(*a, sm_scale=0.5, lse_base="2", **kw), zeros_like_specs(specs(**spec_kw)), "cuda")
    assert FFI_TARGET not in text
    assert "custom_call" not in text


def test_cpu_lowering_is_reference():
    text = lower_text(lambda *a: attn_dist(*a, lse_base="2", sm_scale=0.5), zeros_like_specs(specs()), "cpu")
    assert FFI_TARGET not in text


def test_kernel_supports():
    def prob(**kw):
        d = dict(batched=True, B=2, S=9, H=100, D=576, N=10, HK=1, T=3, dtype=jnp.dtype(BF16))
        d.update(kw)
        return Problem(**d)

    assert kernel_supports(prob()) == (True, "supported")
    assert kernel_supports(prob(D=512, H=1, T=1, S=1))[0]
    for bad, word in ((dict(D=128), "D"), (dict(HK=2, H=4), "HK"), (dict(dtype=jnp.dtype(jnp.float16)), "bfloat16")):
        ok, why = kernel_supports(prob(**bad))
        assert not ok and word in why


def test_implementation_cuda_without_kernel_raises(monkeypatch):
    monkeypatch.setattr(ext, "_state", ext._State(False, "not built (test)"))
    args = zeros_like_specs(specs())
    with pytest.raises(RuntimeError, match="not available"):
        attn_dist(*args, lse_base="2", sm_scale=0.5, implementation="cuda")


def test_implementation_cuda_unsupported_problem_raises():
    args = zeros_like_specs(specs(D=128))
    with pytest.raises(ValueError, match="D = 128"):
        jax.eval_shape(lambda *a: attn_dist(*a, lse_base="2", sm_scale=0.5, implementation="cuda"), *args)


def test_implementation_cuda_lowering_for_cpu_raises(fake_kernel_available):
    args = zeros_like_specs(specs())
    f = lambda *a: attn_dist(*a, lse_base="2", sm_scale=0.5, implementation="cuda")
    with pytest.raises(ValueError, match="needs a CUDA device; lowering for cpu"):
        lower_text(f, args, "cpu")
    (call,) = custom_calls(lower_text(f, args, "cuda"))


def test_no_kernel_on_local_gpu_falls_back(monkeypatch):
    """A process with a CUDA backend but no registered kernel uses the XLA path."""
    monkeypatch.setattr(primitives, "local_cuda_backend", lambda: True)
    monkeypatch.setattr(ext, "_state", ext._State(False, "not built (test)"))
    text = lower_text(lambda *a: attn_dist(*a, lse_base="2", sm_scale=0.5), zeros_like_specs(specs()), "cuda")
    assert FFI_TARGET not in text


# ----------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------


def _base(batched):
    B = 2 if batched else None
    q, k, i, l = zeros_like_specs(specs(B=B, S=5, H=4, D=8, N=7, T=3))
    return dict(q=q, k=k, indices=i, lse=l), dict(sm_scale=0.5, lse_base="2")


def _arr(shape, dtype):
    return jnp.zeros(shape, dtype)


# (id, batched, mutation(arrays, kwargs) -> None, exception, argument named)
BAD = [
    ("q-rank2", False, lambda a, k: a.update(q=_arr((5, 4), BF16)), ValueError, "q"),
    ("q-rank5", True, lambda a, k: a.update(q=_arr((1, 2, 5, 4, 8), BF16)), ValueError, "q"),
    ("k-rank", False, lambda a, k: a.update(k=_arr((1, 7, 1, 8), BF16)), ValueError, "k"),
    ("k-rank-b", True, lambda a, k: a.update(k=_arr((7, 1, 8), BF16)), ValueError, "k"),
    ("indices-rank", False, lambda a, k: a.update(indices=_arr((5, 3), jnp.int32)), ValueError, "indices"),
    ("lse-rank", True, lambda a, k: a.update(lse=_arr((5, 4), jnp.float32)), ValueError, "lse"),
    ("q-int", False, lambda a, k: a.update(q=_arr((5, 4, 8), jnp.int32)), TypeError, "q"),
    ("q-f64-numpy", False, lambda a, k: a.update(q=np.zeros((5, 4, 8))), TypeError, "q"),
    ("k-dtype", False, lambda a, k: a.update(k=_arr((7, 1, 8), jnp.float16)), TypeError, "k"),
    ("indices-f32", False, lambda a, k: a.update(indices=_arr((5, 1, 3), jnp.float32)), TypeError, "indices"),
    ("indices-i64-numpy", True, lambda a, k: a.update(indices=np.zeros((2, 5, 1, 3), np.int64)), TypeError, "indices"),
    ("lse-bf16", False, lambda a, k: a.update(lse=_arr((5, 4), BF16)), TypeError, "lse"),
    ("q-list", False, lambda a, k: a.update(q=[[1.0]]), TypeError, "q"),
    ("S-indices", False, lambda a, k: a.update(indices=_arr((6, 1, 3), jnp.int32)), ValueError, "indices"),
    ("S-lse", True, lambda a, k: a.update(lse=_arr((2, 6, 4), jnp.float32)), ValueError, "lse"),
    ("H-lse", False, lambda a, k: a.update(lse=_arr((5, 3), jnp.float32)), ValueError, "lse"),
    ("D-k", False, lambda a, k: a.update(k=_arr((7, 1, 9), BF16)), ValueError, "k"),
    ("B-k", True, lambda a, k: a.update(k=_arr((3, 7, 1, 8), BF16)), ValueError, "k"),
    ("B-indices", True, lambda a, k: a.update(indices=_arr((3, 5, 1, 3), jnp.int32)), ValueError, "indices"),
    ("B-lse", True, lambda a, k: a.update(lse=_arr((1, 5, 4), jnp.float32)), ValueError, "lse"),
    ("HK-indices", False, lambda a, k: a.update(indices=_arr((5, 2, 3), jnp.int32)), ValueError, "indices"),
    ("H%HK", False, lambda a, k: a.update(k=_arr((7, 3, 8), BF16), indices=_arr((5, 3, 3), jnp.int32)), ValueError, "k"),
    ("H0", False, lambda a, k: a.update(q=_arr((5, 0, 8), BF16), lse=_arr((5, 0), jnp.float32)), ValueError, "q"),
    ("k_stride0", False, lambda a, k: k.update(k_stride=0), ValueError, "k_stride"),
    ("k_stride-neg", False, lambda a, k: k.update(k_stride=-2), ValueError, "k_stride"),
    ("k_stride-float", False, lambda a, k: k.update(k_stride=2.0), TypeError, "k_stride"),
    ("k_stride-bool", False, lambda a, k: k.update(k_stride=True), TypeError, "k_stride"),
    ("k_stride-array", False, lambda a, k: k.update(k_stride=jnp.int32(2)), TypeError, "k_stride"),
    ("sm_scale0", False, lambda a, k: k.update(sm_scale=0.0), ValueError, "sm_scale"),
    ("sm_scale-neg", False, lambda a, k: k.update(sm_scale=-0.1), ValueError, "sm_scale"),
    ("sm_scale-inf", False, lambda a, k: k.update(sm_scale=float("inf")), ValueError, "sm_scale"),
    ("sm_scale-nan", False, lambda a, k: k.update(sm_scale=float("nan")), ValueError, "sm_scale"),
    ("sm_scale-f32-overflow", False, lambda a, k: k.update(sm_scale=1e39), ValueError, "sm_scale"),
    ("sm_scale-f32-underflow", False, lambda a, k: k.update(sm_scale=1e-50), ValueError, "sm_scale"),
    ("q_start-np-int64-overflow", False, lambda a, k: k.update(q_start_index=np.int64(2**31)), ValueError,
     "q_start_index"),
    ("q_start-uint32-array-overflow", False,
     lambda a, k: k.update(q_start_index=np.array(2**31, np.uint32)), ValueError, "q_start_index"),
    ("sm_scale-str", False, lambda a, k: k.update(sm_scale="0.1"), TypeError, "sm_scale"),
    ("sm_scale-none", False, lambda a, k: k.update(sm_scale=None), TypeError, "sm_scale"),
    ("sm_scale-array", False, lambda a, k: k.update(sm_scale=jnp.float32(0.1)), TypeError, "sm_scale"),
    ("causal-str", False, lambda a, k: k.update(causal="yes"), TypeError, "causal"),
    ("lse_base-10", False, lambda a, k: k.update(lse_base="10"), ValueError, "lse_base"),
    ("lse_base-missing", False, lambda a, k: k.pop("lse_base"), TypeError, "lse_base"),
    ("q-f16-k-bf16", False, lambda a, k: a.update(q=_arr((5, 4, 8), jnp.float16)), TypeError, "q"),
    ("lse_base-int", False, lambda a, k: k.update(lse_base=2), ValueError, "lse_base"),
    ("q_start-float", False, lambda a, k: k.update(q_start_index=1.5), TypeError, "q_start_index"),
    ("q_start-f32-array", False, lambda a, k: k.update(q_start_index=jnp.float32(1)), TypeError, "q_start_index"),
    ("q_start-bool", False, lambda a, k: k.update(q_start_index=True), TypeError, "q_start_index"),
    ("q_start-[B]-unbatched", False, lambda a, k: k.update(q_start_index=jnp.zeros((2,), jnp.int32)), ValueError, "q_start_index"),
    ("q_start-wrong-B", True, lambda a, k: k.update(q_start_index=jnp.zeros((3,), jnp.int32)), ValueError, "q_start_index"),
    ("q_start-2d", True, lambda a, k: k.update(q_start_index=jnp.zeros((2, 1), jnp.int32)), ValueError, "q_start_index"),
    ("q_start-overflow", False, lambda a, k: k.update(q_start_index=2**31), ValueError, "q_start_index"),
]
BAD_IMPL = [
    ("implementation-triton", False, lambda a, k: k.update(implementation="triton"), ValueError, "implementation"),
    ("implementation-CUDA", False, lambda a, k: k.update(implementation="CUDA"), ValueError, "implementation"),
]


def _check_bad(fn, batched, mutate, exc, arg):
    arrays, kwargs = _base(batched)
    mutate(arrays, kwargs)
    with pytest.raises(exc) as info:
        fn(arrays["q"], arrays["k"], arrays["indices"], arrays["lse"], **kwargs)
    msg = str(info.value)
    assert f"`{arg}`" in msg, msg
    assert msg.startswith("attn_dist")


@pytest.mark.parametrize("fn", [attn_dist, attn_dist_reference], ids=["attn_dist", "reference"])
@pytest.mark.parametrize("name,batched,mutate,exc,arg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(fn, name, batched, mutate, exc, arg):
    _check_bad(fn, batched, mutate, exc, arg)


@pytest.mark.parametrize("name,batched,mutate,exc,arg", BAD_IMPL, ids=[b[0] for b in BAD_IMPL])
def test_bad_implementation(name, batched, mutate, exc, arg):
    _check_bad(attn_dist, batched, mutate, exc, arg)


def test_bad_inputs_under_jit_raise_at_trace_time():
    arrays, _ = _base(False)
    bad_lse = jnp.zeros((5, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"`lse` must have shape \[S, H\] = \[5, 4\], got \[5, 3\]"):
        jax.jit(lambda q, k, i, l: attn_dist(q, k, i, l, lse_base="2", sm_scale=0.5))(arrays["q"], arrays["k"], arrays["indices"], bad_lse)


def test_error_message_names_expected_and_actual():
    arrays, _ = _base(True)
    with pytest.raises(TypeError) as info:
        attn_dist(arrays["q"], arrays["k"].astype(jnp.float32), arrays["indices"], arrays["lse"], lse_base="2", sm_scale=0.5)
    assert "bfloat16" in str(info.value) and "float32" in str(info.value)


@pytest.mark.parametrize("fn", [attn_dist, attn_dist_reference], ids=["attn_dist", "reference"])
def test_lse_base_is_explicit_and_names_the_producers(fn):
    """A wrong base gives silently wrong targets, so there is no default, and
    the error says which producer writes which base."""
    arrays, kwargs = _base(False)
    kwargs.pop("lse_base")
    with pytest.raises(TypeError, match=r'`lse_base` is required: pass "e" .*FlashMLA, cuDNN.* "2" .*sparse_mla_fwd'):
        fn(*arrays.values(), **kwargs)


def test_mismatched_dtypes_name_both_arguments():
    """A float16 q beside a bfloat16 k blames neither alone."""
    arrays, kwargs = _base(False)
    with pytest.raises(TypeError, match=r"`q` and `k` must have the same dtype .* got `q` float16 and `k` bfloat16"):
        attn_dist(arrays["q"].astype(jnp.float16), arrays["k"], arrays["indices"], arrays["lse"], **kwargs)
