"""sparse_mla: shapes, the CUDA lowering (the FFI call's operands, results and
attributes, lowered on a CPU-only process), implementation selection, kernel
coverage and input errors (CPU)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jax_attn_dist import sparse_mla, sparse_mla_kernel_supports, sparse_mla_p, sparse_mla_reference
from jax_attn_dist._core import ext, primitives
from jax_attn_dist.ops.sparse_mla.contract import FFI_TARGET, KERNEL_HEAD_DIMS, Problem
from jaxpr_util import iter_eqns

BF16 = jnp.bfloat16
SDS = jax.ShapeDtypeStruct

# Every test here lowers for CUDA as a CPU-only process does (conftest).
pytestmark = pytest.mark.usefixtures("cross_lowering")


def specs(B=None, S=5, H=3, D=576, N=7, HK=1, T=4, dtype=BF16):
    lead = (B,) if B is not None else ()
    return (SDS(lead + (S, H, D), dtype), SDS(lead + (N, HK, D), dtype), SDS(lead + (S, HK, T), jnp.int32))


def zeros(s):
    return tuple(jnp.zeros(x.shape, x.dtype) for x in s)


@pytest.mark.parametrize("fn", [sparse_mla, sparse_mla_reference], ids=["sparse_mla", "reference"])
@pytest.mark.parametrize("B,dtype", [(None, BF16), (2, BF16), (3, jnp.float32)])
def test_eval_shape(fn, B, dtype):
    out, lse = jax.eval_shape(lambda *a: fn(*a, sm_scale=0.1), *specs(B=B, H=70, dtype=dtype))
    lead = (B,) if B is not None else ()
    assert out.shape == lead + (5, 70, 512) and out.dtype == dtype
    assert lse.shape == lead + (5, 70) and lse.dtype == jnp.float32


def test_eval_shape_benchmark_size():
    s = specs(B=1, S=4096, H=128, D=576, N=131072, T=2048)
    out, lse = jax.eval_shape(lambda *a: sparse_mla(*a, sm_scale=0.1, q_start_index=jnp.zeros((1,), jnp.int32)), *s)
    assert out.shape == (1, 4096, 128, 512) and lse.shape == (1, 4096, 128)


@pytest.mark.parametrize("B", [None, 2])
def test_primitive_operands_and_params(B):
    jaxpr = jax.make_jaxpr(lambda *a: sparse_mla(*a, sm_scale=0.25, k_stride=2, lse_base="e", d_v=300,
                                                 deterministic=True))(*specs(B=B, H=100))
    (e,) = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive is sparse_mla_p]
    Bc = B or 1
    assert [v.aval.shape for v in e.invars] == [(Bc, 5, 100, 576), (Bc, 7, 1, 576), (Bc, 5, 1, 4), (Bc,), (Bc, 5, 0)]
    assert [v.aval.shape for v in e.outvars] == [(Bc, 5, 100, 300), (Bc, 5, 100)]
    assert e.params == dict(sm_scale=0.25, causal=True, k_stride=2, lse_base="e", d_v=300, deterministic=True,
                            implementation=None)


def test_empty_problem_binds_nothing():
    jaxpr = jax.make_jaxpr(lambda *a: sparse_mla(*a, sm_scale=0.1))(*specs(T=0))
    assert not [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive is sparse_mla_p]


# ----------------------------------------------------------------------------
# lowering and implementation selection
# ----------------------------------------------------------------------------

_CALL = re.compile(rf"stablehlo\.custom_call @{FFI_TARGET}\(([^)]*)\)(.*)")


def lower_text(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def custom_calls(text):
    return [m for m in (_CALL.search(line) for line in text.splitlines()) if m]


@pytest.mark.parametrize("B", [None, 3])
@pytest.mark.parametrize("D", KERNEL_HEAD_DIMS)
def test_cuda_lowering_emits_ffi_call(B, D):
    """Operands q, kv, indices, q_start, row_ranges; results out (bf16) and
    lse (f32); attributes sm_scale f32, causal, k_stride i32, lse_base_e.
    Lowering for CUDA needs no GPU and no built extension."""
    args = zeros(specs(B=B, H=130, D=D))
    qs = jnp.asarray([1, 2, 3] if B else 4, jnp.int32)

    def f(q, kv, i, s):
        return sparse_mla(q, kv, i, sm_scale=0.1234, causal=False, q_start_index=s, k_stride=4, lse_base="e")

    calls = custom_calls(lower_text(f, (*args, qs), "cuda"))
    assert len(calls) == 1
    operands, rest = calls[0].group(1), calls[0].group(2)
    assert len(operands.split(",")) == 5
    Bc = B or 1
    sig = (f"(tensor<{Bc}x5x130x{D}xbf16>, tensor<{Bc}x7x1x{D}xbf16>, tensor<{Bc}x5x1x4xi32>, tensor<{Bc}xi32>, "
           f"tensor<{Bc}x5x0xi32>) -> (tensor<{Bc}x5x130x512xbf16>, tensor<{Bc}x5x130xf32>)")
    assert sig in rest, rest
    assert re.search(r"sm_scale = 1\.234000e-01 : f32", rest), rest
    assert "k_stride = 4 : i32" in rest and "causal = false" in rest and "lse_base_e = true" in rest
    attrs = re.search(r"backend_config = \{([^}]*)\}", rest).group(1)
    assert sorted(a.split("=")[0].strip() for a in attrs.split(",")) == ["causal", "k_stride", "lse_base_e",
                                                                           "sm_scale"]


def test_cuda_lowering_defaults_and_packed_ranges():
    """Default attributes; SPEC §6's keywords become row_ranges [B, S, 3] and
    causal=false (the ranges hold the whole rule)."""
    args = zeros(specs())
    (call,) = custom_calls(lower_text(lambda *a: sparse_mla(*a, sm_scale=0.5), args, "cuda"))
    rest = call.group(2)
    assert "causal = true" in rest and "k_stride = 1 : i32" in rest and "lse_base_e = false" in rest
    tl = jnp.zeros((5,), jnp.int32)
    (call,) = custom_calls(lower_text(lambda q, kv, i, t: sparse_mla(q, kv, i, sm_scale=0.5, topk_length=t),
                                      (*args, tl), "cuda"))
    assert "tensor<1x5x3xi32>" in call.group(1) + call.group(2) and "causal = false" in call.group(2)


@pytest.mark.parametrize("kw,spec_kw", [
    (dict(implementation="xla"), {}),
    ({}, dict(D=128)),
    ({}, dict(dtype=jnp.float32)),
    ({}, dict(H=4, HK=2)),
    (dict(d_v=256), {}),
], ids=["xla", "D128", "f32", "HK2", "dv256"])
def test_cuda_lowering_falls_back_to_reference(kw, spec_kw):
    text = lower_text(lambda *a: sparse_mla(*a, sm_scale=0.5, **dict(dict(d_v=min(512, spec_kw.get("D", 576))), **kw)),
                      zeros(specs(**spec_kw)), "cuda")
    assert FFI_TARGET not in text and "custom_call" not in text


def test_cpu_lowering_is_reference():
    assert FFI_TARGET not in lower_text(lambda *a: sparse_mla(*a, sm_scale=0.5), zeros(specs()), "cpu")


def test_kernel_supports():
    def prob(**kw):
        d = dict(batched=True, B=2, S=9, H=100, D=576, N=10, HK=1, T=3, dtype=jnp.dtype(BF16))
        d.update(kw)
        return Problem(**d)

    assert sparse_mla_kernel_supports(prob()) == (True, "supported")
    for good in (dict(D=512, H=1, T=1, S=1), dict(H=200, T=4097)):
        assert sparse_mla_kernel_supports(prob(**good))[0]
    for bad, word in ((dict(D=128), "D"), (dict(HK=2, H=4), "HK"), (dict(dtype=jnp.dtype(jnp.float32)), "bfloat16")):
        ok, why = sparse_mla_kernel_supports(prob(**bad))
        assert not ok and word in why
    ok, why = sparse_mla_kernel_supports(prob(), d_v=256)
    assert not ok and "d_v" in why


def test_implementation_cuda_without_kernel_raises(monkeypatch):
    monkeypatch.setattr(ext, "_state", ext._State(False, "not built (test)"))
    with pytest.raises(RuntimeError, match="not available"):
        sparse_mla(*zeros(specs()), sm_scale=0.5, implementation="cuda")


def test_implementation_cuda_unsupported_problem_raises():
    with pytest.raises(ValueError, match=r"^sparse_mla: implementation='cuda' cannot serve this call: .*d_v = 100"):
        sparse_mla(*zeros(specs()), sm_scale=0.5, d_v=100, implementation="cuda")


def test_implementation_cuda_lowering_for_cpu_raises(fake_kernel_available):
    f = lambda *a: sparse_mla(*a, sm_scale=0.5, implementation="cuda")  # noqa: E731
    with pytest.raises(ValueError, match="needs a CUDA device; lowering for cpu"):
        lower_text(f, zeros(specs()), "cpu")
    (call,) = custom_calls(lower_text(f, zeros(specs()), "cuda"))


def test_no_kernel_on_local_gpu_falls_back(monkeypatch):
    monkeypatch.setattr(primitives, "local_cuda_backend", lambda: True)
    monkeypatch.setattr(ext, "_state", ext._State(False, "not built (test)"))
    assert FFI_TARGET not in lower_text(lambda *a: sparse_mla(*a, sm_scale=0.5), zeros(specs()), "cuda")


# ----------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------


def _base(batched):
    q, kv, i = zeros(specs(B=2 if batched else None, S=5, H=4, D=8, N=7, T=3))
    return dict(q=q, kv=kv, indices=i), dict(sm_scale=0.5, d_v=8)


def _arr(shape, dtype):
    return jnp.zeros(shape, dtype)


# (id, batched, mutation(arrays, kwargs), exception, argument named)
BAD = [
    ("q-rank2", False, lambda a, k: a.update(q=_arr((5, 4), BF16)), ValueError, "q"),
    ("kv-rank", False, lambda a, k: a.update(kv=_arr((1, 7, 1, 8), BF16)), ValueError, "kv"),
    ("indices-rank", True, lambda a, k: a.update(indices=_arr((2, 5, 3), jnp.int32)), ValueError, "indices"),
    ("q-int", False, lambda a, k: a.update(q=_arr((5, 4, 8), jnp.int32)), TypeError, "q"),
    ("kv-dtype", False, lambda a, k: a.update(kv=_arr((7, 1, 8), jnp.float16)), TypeError, "kv"),
    ("indices-f32", False, lambda a, k: a.update(indices=_arr((5, 1, 3), jnp.float32)), TypeError, "indices"),
    ("q-list", False, lambda a, k: a.update(q=[[1.0]]), TypeError, "q"),
    ("S-indices", False, lambda a, k: a.update(indices=_arr((6, 1, 3), jnp.int32)), ValueError, "indices"),
    ("D-kv", False, lambda a, k: a.update(kv=_arr((7, 1, 9), BF16)), ValueError, "kv"),
    ("B-kv", True, lambda a, k: a.update(kv=_arr((3, 7, 1, 8), BF16)), ValueError, "kv"),
    ("H%HK", False, lambda a, k: a.update(kv=_arr((7, 3, 8), BF16), indices=_arr((5, 3, 3), jnp.int32)),
     ValueError, "kv"),
    ("d_v-too-big", False, lambda a, k: k.update(d_v=9), ValueError, "d_v"),
    ("d_v-0", False, lambda a, k: k.update(d_v=0), ValueError, "d_v"),
    ("d_v-float", False, lambda a, k: k.update(d_v=8.0), TypeError, "d_v"),
    ("d_v-default-512-over-D", False, lambda a, k: k.pop("d_v"), ValueError, "d_v"),
    ("lse_base-10", False, lambda a, k: k.update(lse_base="10"), ValueError, "lse_base"),
    ("lse_base-none", False, lambda a, k: k.update(lse_base=None), ValueError, "lse_base"),
    ("lse_base-int", False, lambda a, k: k.update(lse_base=2), ValueError, "lse_base"),
    ("sm_scale-0", False, lambda a, k: k.update(sm_scale=0.0), ValueError, "sm_scale"),
    ("sm_scale-missing", False, lambda a, k: k.update(sm_scale=None), TypeError, "sm_scale"),
    ("k_stride-0", False, lambda a, k: k.update(k_stride=0), ValueError, "k_stride"),
    ("causal-str", False, lambda a, k: k.update(causal="yes"), TypeError, "causal"),
    ("deterministic-str", False, lambda a, k: k.update(deterministic="yes"), TypeError, "deterministic"),
    ("q_start-wrong-B", True, lambda a, k: k.update(q_start_index=jnp.zeros((3,), jnp.int32)), ValueError,
     "q_start_index"),
    ("q_start-float", False, lambda a, k: k.update(q_start_index=1.5), TypeError, "q_start_index"),
    ("topk_length-shape", False, lambda a, k: k.update(topk_length=jnp.zeros((4,), jnp.int32)), ValueError,
     "topk_length"),
    ("cu_seqlens-batched", True, lambda a, k: k.update(cu_seqlens_q=jnp.zeros((2,), jnp.int32),
                                                      cu_seqlens_k=jnp.zeros((2,), jnp.int32)), ValueError,
     "cu_seqlens_q"),
    ("cu_seqlens-alone", False, lambda a, k: k.update(cu_seqlens_q=jnp.zeros((2,), jnp.int32)), ValueError,
     "cu_seqlens_q"),
    ("implementation", False, lambda a, k: k.update(implementation="triton"), ValueError, "implementation"),
]


@pytest.mark.parametrize("name,batched,mutate,exc,arg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, batched, mutate, exc, arg):
    arrays, kwargs = _base(batched)
    mutate(arrays, kwargs)
    with pytest.raises(exc) as info:
        sparse_mla(arrays["q"], arrays["kv"], arrays["indices"], **kwargs)
    msg = str(info.value)
    assert f"`{arg}`" in msg, msg
    assert msg.startswith("sparse_mla"), msg


def test_reference_names_itself():
    arrays, kwargs = _base(False)
    with pytest.raises(ValueError, match=r"^sparse_mla_reference: `d_v`"):
        sparse_mla_reference(*arrays.values(), **dict(kwargs, d_v=100))


def test_lse_base_error_says_which_base_is_which():
    arrays, kwargs = _base(False)
    with pytest.raises(ValueError, match=r'`lse_base` \(the base of the returned lse\) must be "2" .*sparse_mla_fwd.*'
                                         r'"e" .*FlashMLA.*attn_dist; got \'E\''):
        sparse_mla(*arrays.values(), **dict(kwargs, lse_base="E"))


def test_errors_raise_at_trace_time_under_jit():
    arrays, kwargs = _base(False)
    with pytest.raises(ValueError, match=r"`indices` must have shape \[S, HK, T\] = \[5, 1, 3\]"):
        jax.jit(lambda q, kv, i: sparse_mla(q, kv, i, **kwargs))(arrays["q"], arrays["kv"], jnp.zeros((4, 1, 3), jnp.int32))


def test_mismatched_dtypes_name_both_arguments():
    arrays, kwargs = _base(False)
    with pytest.raises(TypeError, match=r"`q` and `kv` must have the same dtype .* got `q` float16 and `kv` bfloat16"):
        sparse_mla(arrays["q"].astype(jnp.float16), arrays["kv"], arrays["indices"], **kwargs)
