"""sparse_mla's backward primitive (``sparse_mla_bwd_p``) on the CPU: its CUDA
lowering (the FFI call's operands, results, attributes and workspace, lowered
on a CPU-only process, in both modes) and where it takes the jnp pass
instead; the jnp lowering equal to ``backward.sparse_mla_bwd_canonical``;
vmap; B, S and H shardings on 8 host devices (dkv psum'ed over S and H);
and its abstract evaluation's errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from inputs import seed_of
from jax_attn_dist import sparse_mla
from jax_attn_dist._core import checks, fixed_point
from jax_attn_dist.ops.sparse_mla import contract
from jax_attn_dist.ops.sparse_mla.backward import sparse_mla_bwd_canonical
from jax_attn_dist.ops.sparse_mla.contract import BWD_FFI_TARGET, FFI_TARGET, KERNEL_HEAD_DIMS, Problem
from jax_attn_dist.ops.sparse_mla.primitive import sparse_mla_bwd_p, sparse_mla_p
from jax_attn_dist.ops.sparse_mla.sharded_fixed_point import sharded_deterministic_backward
from jaxpr_util import iter_eqns, reductions
from sharding_util import collectives, partitioner
from sparse_mla_cases import make_sparse_mla_inputs

F32 = jnp.float32
BF16 = jnp.bfloat16
SDS = jax.ShapeDtypeStruct


def lower_text(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def call_lines(text, target):
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]


def grad_of_both_results(**kw):
    """d/d(q, kv) of a loss reading both out and lse."""
    def loss(q, kv, i):
        out, lse = sparse_mla(q, kv, i, **kw)
        return jnp.sum(out.astype(F32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.grad(loss, argnums=(0, 1))


def zeros(B=2, S=5, H=3, D=576, N=7, HK=1, T=4, dtype=BF16):
    return (jnp.zeros((B, S, H, D), dtype), jnp.zeros((B, N, HK, D), dtype), jnp.zeros((B, S, HK, T), jnp.int32))


# ----------------------------------------------------------------------------
# the CUDA lowering (no GPU needed)
# ----------------------------------------------------------------------------


def test_workspace_bytes():
    """Row terms (float32 per (b, s, h)), then, when deterministic, the int64
    dkv sums and two uint32 scale words per batch element; each part
    256-byte aligned."""
    q, kv = (2, 5, 3, 576), (2, 7, 1, 576)
    assert contract.bwd_workspace_bytes(q, kv, deterministic=False) == 256            # 120 B of row terms
    assert contract.bwd_workspace_bytes(q, kv, deterministic=True) == 256 + 2 * 7 * 576 * 8 + 256
    q, kv = (1, 100, 128, 512), (1, 33, 1, 512)
    assert contract.bwd_workspace_bytes(q, kv, deterministic=False) == 51200
    assert contract.bwd_workspace_bytes(q, kv, deterministic=True) == 51200 + 33 * 512 * 8 + 256
    q, kv = (1, 1, 1, 4), (1, 1, 1, 4)   # sums of 32 B: padded to 256
    assert contract.bwd_workspace_bytes(q, kv, deterministic=True) == 256 + 256 + 256
    q, kv = (40, 1, 1, 512), (40, 1, 1, 512)   # 320 B of scale words
    assert contract.bwd_workspace_bytes(q, kv, deterministic=True) == 256 + 40 * 512 * 8 + 512


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("D", KERNEL_HEAD_DIMS)
def test_cuda_lowering_calls_the_backward_kernel(cross_lowering, D, deterministic):
    """Operands q, kv, indices, q_start, row_ranges, out, lse, dout, dlse;
    results dq (bf16), dkv (f32, cast to kv's dtype after the call) and the
    workspace; attributes sm_scale f32, causal, k_stride i32, lse_base_e,
    deterministic."""
    g = grad_of_both_results(sm_scale=0.1234, causal=False, k_stride=4, lse_base="e", q_start_index=3,
                             deterministic=deterministic)
    text = lower_text(g, zeros(D=D), "cuda")
    assert len(call_lines(text, FFI_TARGET)) == 1
    (call,) = call_lines(text, BWD_FFI_TARGET)
    operands = re.search(rf"@{BWD_FFI_TARGET}\(([^)]*)\)", call).group(1)
    assert len(operands.split(",")) == 9, operands
    workspace = contract.bwd_workspace_bytes((2, 5, 3, D), (2, 7, 1, D), deterministic=deterministic)
    assert workspace == 256 + (2 * 7 * D * 8 + 256 if deterministic else 0)
    sig = (f"(tensor<2x5x3x{D}xbf16>, tensor<2x7x1x{D}xbf16>, tensor<2x5x1x4xi32>, tensor<2xi32>, "
           f"tensor<2x5x0xi32>, tensor<2x5x3x512xbf16>, tensor<2x5x3xf32>, tensor<2x5x3x512xbf16>, "
           f"tensor<2x5x3xf32>) -> (tensor<2x5x3x{D}xbf16>, tensor<2x7x1x{D}xf32>, tensor<{workspace}xui8>)")
    assert sig in call, call
    attrs = re.search(r"mhlo\.backend_config = \{([^}]*)\}", call).group(1)
    assert sorted(a.split("=")[0].strip() for a in attrs.split(",")) == [
        "causal", "deterministic", "k_stride", "lse_base_e", "sm_scale"]
    assert re.search(r"sm_scale = 1\.234000e-01 : f32", attrs), attrs
    assert "causal = false" in attrs and "k_stride = 4 : i32" in attrs and "lse_base_e = true" in attrs
    assert f"deterministic = {str(deterministic).lower()}" in attrs


def test_cuda_lowering_of_the_backward_defaults_and_packed_ranges(cross_lowering):
    """Default attributes; SPEC §6's keywords reach the backward as
    row_ranges [B, S, 3]."""
    text = lower_text(grad_of_both_results(sm_scale=0.5), zeros(), "cuda")
    (call,) = call_lines(text, BWD_FFI_TARGET)
    assert "causal = true" in call and "k_stride = 1 : i32" in call and "lse_base_e = false" in call
    assert "deterministic = false" in call
    tl = jnp.zeros((2, 5), jnp.int32)

    def loss(q, kv, i, t):
        out, lse = sparse_mla(q, kv, i, sm_scale=0.5, topk_length=t)
        return jnp.sum(out.astype(F32))

    (call,) = call_lines(lower_text(jax.grad(loss, argnums=(0, 1)), (*zeros(), tl), "cuda"), BWD_FFI_TARGET)
    assert "tensor<2x5x3xi32>" in call and "causal = false" in call


def test_implementation_cuda_binds_the_forward_only(cross_lowering, fake_kernel_available):
    """implementation="cuda" binds the forward to its kernel; the backward
    takes None (its kernel here)."""
    text = lower_text(grad_of_both_results(sm_scale=0.5, implementation="cuda"), zeros(), "cuda")
    assert len(call_lines(text, FFI_TARGET)) == 1 and len(call_lines(text, BWD_FFI_TARGET)) == 1


@pytest.mark.parametrize("kw,shape", [
    (dict(implementation="xla"), {}),
    ({}, dict(D=128)),
    ({}, dict(dtype=F32)),
    ({}, dict(H=4, HK=2)),
    (dict(d_v=256), {}),
], ids=["xla", "D128", "f32", "HK2", "dv256"])
def test_cuda_lowering_of_the_backward_falls_back_to_jnp(cross_lowering, kw, shape):
    kw = dict(dict(sm_scale=0.5, d_v=min(512, shape.get("D", 576))), **kw)
    text = lower_text(grad_of_both_results(**kw), zeros(**shape), "cuda")
    assert "custom_call" not in text


def test_cpu_lowering_of_the_backward_is_jnp():
    assert "custom_call" not in lower_text(grad_of_both_results(sm_scale=0.5), zeros(), "cpu")


def test_bwd_kernel_supports_the_forward_coverage():
    def prob(**kw):
        d = dict(batched=True, B=2, S=9, H=100, D=576, N=10, HK=1, T=3, dtype=jnp.dtype(BF16))
        d.update(kw)
        return Problem(**d)

    for p in (prob(), prob(D=512, H=1), prob(D=128), prob(HK=2, H=4), prob(dtype=jnp.dtype(F32))):
        for d_v in (512, 256):
            assert contract.bwd_kernel_supports(p, d_v=d_v) == contract.kernel_supports(p, d_v=d_v)
    assert contract.bwd_kernel_supports(prob()) == (True, "supported")


# ----------------------------------------------------------------------------
# the primitive on the CPU: jnp lowering, vmap, sharding
# ----------------------------------------------------------------------------


def bwd_operands(tag, *, B=2, S=6, H=4, D=16, N=12, T=8, d_v=8):
    """Canonical operands of sparse_mla_bwd_p (float32; out and lse from the
    forward, random cotangents) and its parameters."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("bwd-prim", tag), B=B, S=S, H=H, D=D, N=N, T=T, d_v=d_v,
                                            dtype=F32, q_start_index="batch", empty_rows=0.1)
    q_start = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    params = dict(kw, deterministic=False, implementation=None)
    ranges = checks.no_row_ranges(B, S)
    out, lse = jax.jit(lambda *a: sparse_mla_p.bind(*a, **params))(q, kv, idx, q_start, ranges)
    rng = np.random.default_rng(seed_of("bwd-prim-cot", tag))
    dout = jnp.asarray(rng.standard_normal(out.shape), F32)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), F32)
    return (q, kv, idx, q_start, ranges, out, lse, dout, dlse), params


def bind_bwd(params):
    return lambda *a: tuple(sparse_mla_bwd_p.bind(*a, **params))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_jnp_lowering_is_the_chunked_backward(deterministic):
    """The primitive's jnp lowering is sparse_mla_bwd_canonical (bit for bit),
    which does not read out."""
    ops, params = bwd_operands("jnp")
    params = dict(params, deterministic=deterministic)
    got = jax.jit(bind_bwd(params))(*ops)
    q, kv, idx, q_start, ranges, out, lse, dout, dlse = ops
    want = jax.jit(lambda *a: sparse_mla_bwd_canonical(*a, **params))(q, kv, idx, q_start, ranges, lse, dout, dlse)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    no_out = jax.jit(bind_bwd(params))(*ops[:5], jnp.zeros_like(out), *ops[6:])
    for a, b in zip(no_out, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_folds_into_batch_and_equals_loop():
    """vmap binds the backward once with B = V * B (kv shared: broadcast),
    and equals a loop."""
    ops, params = bwd_operands("vmap", B=2)
    V = 3
    rng = np.random.default_rng(seed_of("bwd-vmap"))
    stacked = [jnp.stack([x] * V) for x in ops]
    for i in (7, 8):  # the cotangents differ per vmapped element
        stacked[i] = jnp.asarray(rng.standard_normal(stacked[i].shape), F32)
    in_axes = (0, None) + (0,) * 7
    args = stacked[:1] + [ops[1]] + stacked[2:]
    f = jax.vmap(bind_bwd(params), in_axes=in_axes)
    got = jax.jit(f)(*args)
    for v in range(V):
        want = jax.jit(bind_bwd(params))(*(x if a is None else x[v] for x, a in zip(args, in_axes)))
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a[v]), np.asarray(b), rtol=1e-6, atol=1e-6)
    eqns = [e for e in iter_eqns(jax.make_jaxpr(f)(*args).jaxpr) if e.primitive is sparse_mla_bwd_p]
    assert len(eqns) == 1 and eqns[0].invars[0].aval.shape[0] == V * 2


def mesh_of(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices("cpu")[:n])


# (name, mesh shape, mesh names, (b, s, h) entries of q, out, lse, dout, dlse)
SHARDINGS = [
    ("B over 2, S over 4", (2, 4), ("x", "y"), ("x", "y", None)),
    ("H over 8", (8,), ("x",), (None, None, "x")),
    ("S over 2, H over 4", (2, 4), ("x", "y"), (None, "x", "y")),
    ("B over 2, H over 4", (2, 4), ("x", "y"), ("x", None, "y")),
    ("S over 2x4", (2, 4), ("x", "y"), (None, ("x", "y"), None)),
]


def sharded_bwd(mesh, rows, ops, params):
    b, s, h = rows
    values, heads = P(b, s, h), P(b, s, h)
    specs = (values, P(b), P(b, s), P(b), P(b, s), values, heads, values, heads)
    shardings = tuple(NamedSharding(mesh, sp) for sp in specs)
    f = jax.jit(bind_bwd(params), in_shardings=shardings)
    put = [jax.device_put(x, sh) for x, sh in zip(ops, shardings)]
    return f(*put), f.lower(*put).compile().as_text()


@pytest.mark.host_devices(8)
@pytest.mark.parametrize("name,shape,names,rows", SHARDINGS, ids=[c[0] for c in SHARDINGS])
def test_sharded_backward_equals_unsharded(name, shape, names, rows):
    """dq per shard; dkv the psum of the S- and H-shards' partial sums (no
    gather of q or the cotangents)."""
    ops, params = bwd_operands("shard", B=2, S=16, H=8)
    want = jax.jit(bind_bwd(params))(*ops)
    mesh = mesh_of(shape, names)
    got, hlo = sharded_bwd(mesh, rows, ops, params)
    for a, b in zip(got, want):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
    assert "all-gather" not in collectives(hlo)
    partial = rows[1] is not None or rows[2] is not None
    assert ("all-reduce" in collectives(hlo)) == partial, collectives(hlo)


@pytest.mark.host_devices(8)
def test_sharded_backward_under_the_legacy_partitioner():
    ops, params = bwd_operands("shard-gspmd", B=2, S=16, H=8)
    want = jax.jit(bind_bwd(params))(*ops)
    with partitioner(shardy=False):
        got, hlo = sharded_bwd(mesh_of((2, 4), ("x", "y")), (None, "x", "y"), ops, params)
    for a, b in zip(got, want):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.host_devices(8)
def test_gradients_with_heads_sharded():
    """jax.grad of sparse_mla with S and H sharded equals the unsharded
    gradients."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("bwd-grad-heads"), B=2, S=16, H=8, D=16, N=24, T=8, d_v=12,
                                            dtype=F32, q_start_index="batch", empty_rows=0.1)
    qs = kw.pop("q_start_index")

    def loss(q, kv, i, s):
        out, lse = sparse_mla(q, kv, i, q_start_index=s, **kw)
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    g = jax.grad(loss, argnums=(0, 1))
    want = jax.jit(g)(q, kv, idx, qs)
    mesh = mesh_of((2, 4), ("x", "y"))
    sh = [NamedSharding(mesh, s) for s in (P(None, "x", "y"), P(), P(None, "x"), P())]
    got = jax.jit(g, in_shardings=sh)(q, kv, idx, qs)
    for a, b in zip(got, want):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.host_devices(8)
def test_cuda_lowering_in_a_shard_map_has_a_per_shard_backward_call(cross_lowering):
    """(check_vma=False: the primitives' abstract evaluation does not carry
    shard_map's varying-axes types.)"""
    mesh = mesh_of((8,), ("sp",))

    def per_shard(q, kv, i):
        out, lse = sparse_mla(q, kv, i, sm_scale=0.1, q_start_index=jax.lax.axis_index("sp") * 8)
        return out, lse

    f = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(None, "sp"), P(), P(None, "sp")),
                      out_specs=(P(None, "sp"), P(None, "sp")), check_vma=False)

    def loss(q, kv, i):
        out, lse = f(q, kv, i)
        return jnp.sum(out.astype(F32))

    args = (SDS((1, 64, 16, 576), BF16), SDS((1, 100, 1, 576), BF16), SDS((1, 64, 1, 32), jnp.int32))
    text = lower_text(jax.grad(loss, argnums=(0, 1)), args, "cuda")
    (call,) = call_lines(text, BWD_FFI_TARGET)
    assert "tensor<1x8x16x576xbf16>" in call and "tensor<1x100x1x576xf32>" in call, call


@pytest.mark.host_devices(8)
def test_cuda_lowering_of_the_row_sharded_deterministic_backward(cross_lowering):
    """A deterministic backward with rows sharded (sharded_fixed_point.py),
    lowered for CUDA per shard over 2 host devices: the bound call, a max
    all-reduce of the [2, B] scale words, the fixed-point call (scale_rows:
    every shard's rows), sum all-reduces of limbs and flags, and the
    conversion of the summed limbs with the same rows."""
    mesh = mesh_of((2,), ("x",))
    B, S, H, D, N, T = 1, 16, 8, 576, 40, 8
    params = dict(sm_scale=0.1, causal=True, k_stride=1, lse_base="e", d_v=512, deterministic=True,
                  implementation=None)
    args = (SDS((B, S, H, D), BF16), SDS((B, N, 1, D), BF16), SDS((B, S, 1, T), jnp.int32), SDS((B,), jnp.int32),
            SDS((B, S, 0), jnp.int32), SDS((B, S, H, 512), BF16), SDS((B, S, H), F32), SDS((B, S, H, 512), BF16),
            SDS((B, S, H), F32))
    rows, whole = P(None, "x"), P()
    f = jax.shard_map(lambda *ops: sharded_deterministic_backward(ops, params, axes=("x",), scale_rows=S),
                      mesh=mesh, in_specs=(rows, whole, rows, whole, rows, rows, rows, rows, rows),
                      out_specs=(rows, whole), check_vma=False)
    text = lower_text(f, args, "cuda")
    (bound,) = call_lines(text, contract.BWD_BOUND_FFI_TARGET)
    assert "tensor<1x8x8x576xbf16>" in bound and "tensor<2x1xi32>" in bound, bound
    (fixed,) = call_lines(text, contract.BWD_FIXED_FFI_TARGET)
    assert f"scale_rows = {S} : i64" in fixed and "tensor<3x1x40x1x576xi32>" in fixed, fixed
    (convert,) = call_lines(text, fixed_point.LIMBS_TO_FLOAT_TARGET)
    assert f"rows = {S} : i64" in convert and "tensor<3x1x23040xi32>" in convert, convert
    found = reductions(f, *args)  # the words' max; limbs and flags summed
    assert found == [("pmax", ("x",)), ("psum", ("x",)), ("psum", ("x",))], found
    assert text.index(contract.BWD_BOUND_FFI_TARGET) < text.index(contract.BWD_FIXED_FFI_TARGET) < text.index(
        fixed_point.LIMBS_TO_FLOAT_TARGET)


@pytest.mark.host_devices(8)
@pytest.mark.parametrize("q_spec,axes,rows", [
    (P(None, "x"), ("x",), 16),                 # S over 2: the rows of both shards
    (P(None, "x", "y"), ("x", "y"), 16 * 4),    # and H over 4: head shards' terms add
    (P("x", None, "y"), ("y",), 16 * 4),        # B over 2 (no reduction over it), H over 4
], ids=["S", "S-H", "B-H"])
def test_the_partition_decides_the_sharded_deterministic_steps(monkeypatch, q_spec, axes, rows):
    """SparseMlaBwdDecision.run (the per-shard body of the partitioned
    backward) on a 2 x 4 host mesh, the kernel assumed to serve: with
    deterministic=True it takes the sharded steps with the shards' axes and
    the global row count (S of every shard, times the head shards); with
    deterministic=False, or nothing summed across shards, the inner
    primitive."""
    from jax_attn_dist.ops.sparse_mla import partitioning, sharded_fixed_point

    mesh = mesh_of((2, 4), ("x", "y"))
    B, S, H, D, N = 2, 16, 8, 576, 40
    taken = []
    monkeypatch.setattr(sharded_fixed_point, "kernel_serves", lambda *a: True)
    monkeypatch.setattr(sharded_fixed_point, "sharded_deterministic_backward",
                        lambda ops, params, **kw: taken.append(kw) or "steps")
    shapes = [(B, S, H, D), (B, N, 1, D)]
    decision = partitioning.SparseMlaBwdDecision(mesh, shapes, [NamedSharding(mesh, q_spec), None])
    local = SDS((B // mesh_size_of(mesh, decision.b), S // mesh_size_of(mesh, decision.s),
                 H // mesh_size_of(mesh, decision.h), D), BF16)
    params = dict(BWD_PARAMS, deterministic=True)
    assert decision.run(lambda *ops: "inner", [local], params) == "steps"
    assert taken == [dict(axes=axes, scale_rows=rows)], taken
    with pytest.raises(InnerBound):
        decision.run(bind_inner, [local], dict(params, deterministic=False))
    whole = partitioning.SparseMlaBwdDecision(mesh, shapes, [NamedSharding(mesh, P("x")), None])  # B alone
    with pytest.raises(InnerBound):
        whole.run(bind_inner, [local], params)


def mesh_size_of(mesh, axes):
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


class InnerBound(Exception):
    """Raised by bind_inner: the decision bound the inner primitive."""


def bind_inner(*operands):
    raise InnerBound


def test_shard_count_limit_of_the_fixed_point_limbs():
    fixed_point.check_shard_count(fixed_point.MAX_SHARDS, "sparse_mla backward")
    with pytest.raises(ValueError, match=r"sparse_mla backward: deterministic=True .* at most 1024 shards"):
        fixed_point.check_shard_count(fixed_point.MAX_SHARDS + 1, "sparse_mla backward")


# ----------------------------------------------------------------------------
# abstract evaluation
# ----------------------------------------------------------------------------


def bad_operands(**change):
    """Abstract operands of sparse_mla_bwd_p (B=2, S=5, H=3, D=16, N=7,
    T=4, d_v=8), one of them replaced."""
    ops = dict(q=SDS((2, 5, 3, 16), F32), kv=SDS((2, 7, 1, 16), F32), indices=SDS((2, 5, 1, 4), jnp.int32),
               q_start=SDS((2,), jnp.int32), row_ranges=SDS((2, 5, 0), jnp.int32), out=SDS((2, 5, 3, 8), F32),
               lse=SDS((2, 5, 3), F32), dout=SDS((2, 5, 3, 8), F32), dlse=SDS((2, 5, 3), F32))
    ops.update(change)
    return tuple(ops.values())


BWD_PARAMS = dict(sm_scale=0.5, causal=True, k_stride=1, lse_base="2", d_v=8, deterministic=False,
                  implementation=None)


def test_abstract_eval_of_good_operands():
    dq, dkv = jax.eval_shape(bind_bwd(BWD_PARAMS), *bad_operands())
    assert (dq.shape, dq.dtype, dkv.shape, dkv.dtype) == ((2, 5, 3, 16), F32, (2, 7, 1, 16), F32)
    # the cotangents may come in another floating dtype (the kernel call casts them)
    jax.eval_shape(bind_bwd(BWD_PARAMS), *bad_operands(dout=SDS((2, 5, 3, 8), BF16), dlse=SDS((2, 5, 3), BF16)))


@pytest.mark.parametrize("name,bad,message", [
    ("lse", SDS((2, 5, 4), F32), r"`lse` must be float32 \[2, 5, 3\], got float32 \[2, 5, 4\]"),
    ("lse", SDS((2, 5, 3), BF16), r"`lse` must be float32 \[2, 5, 3\], got bfloat16"),
    ("dout", SDS((2, 5, 3, 16), F32), r"`dout` must be floating-point \[2, 5, 3, 8\], got float32 \[2, 5, 3, 16\]"),
    ("dout", SDS((2, 5, 3, 8), jnp.int32), r"`dout` must be floating-point \[2, 5, 3, 8\], got int32"),
    ("out", SDS((2, 5, 3, 8), BF16), r"`out` must be float32 \[2, 5, 3, 8\], got bfloat16"),
    ("dlse", SDS((2, 5), F32), r"`dlse` must be floating-point \[2, 5, 3\], got float32 \[2, 5\]"),
], ids=["lse-shape", "lse-dtype", "dout-shape", "dout-dtype", "out-dtype", "dlse-shape"])
def test_abstract_eval_errors(name, bad, message):
    with pytest.raises(ValueError, match=r"^sparse_mla backward: " + message):
        jax.eval_shape(bind_bwd(BWD_PARAMS), *bad_operands(**{name: bad}))


def test_backward_primitive_keeps_dkv_float32_for_bf16():
    """The per-shard dkv stays float32 through the psum of S- and H-shards;
    the VJP rounds it to kv's dtype once."""
    q = SDS((1, 4, 2, 576), BF16)
    kv = SDS((1, 9, 1, 576), BF16)
    ops = (q, kv, SDS((1, 4, 1, 8), jnp.int32), SDS((1,), jnp.int32), SDS((1, 4, 0), jnp.int32),
           SDS((1, 4, 2, 512), BF16), SDS((1, 4, 2), F32), SDS((1, 4, 2, 512), BF16), SDS((1, 4, 2), F32))
    dq, dkv = jax.eval_shape(bind_bwd(dict(BWD_PARAMS, d_v=512)), *ops)
    assert (dq.dtype, dkv.dtype) == (BF16, F32)
