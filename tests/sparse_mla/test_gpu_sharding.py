"""sparse_mla with the CUDA kernels sharded over 2 GPUs (skipped unless there
are at least 2 CUDA GPUs and the compiled extension registers the kernels,
see conftest.py).

The forward computes each (row, head) from its own slots, so S and H
sharding give one GPU's bits, with one per-shard kernel call and no
collective. The backward with S sharded gives each row's dq in one GPU's
bits; each shard's kv gradient is the partial sum over its rows, added by
one all-reduce, so dkv equals one GPU's up to the float32 order of that
sum. The deterministic mode gives one GPU's bits with S sharded and repeats
its bits with H sharded (SPEC §8.3)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from inputs import require_ffi_targets, seed_of
from jax_attn_dist import oracle, sparse_mla
from jax_attn_dist._core import fixed_point
from jax_attn_dist.ops.sparse_mla.contract import (BWD_BOUND_FFI_TARGET, BWD_FFI_TARGET, BWD_FIXED_FFI_TARGET,
                                                    FFI_TARGET)
from sharding_util import collectives, gpu_mesh, same_bits
from sparse_mla_cases import cotangents, make_sparse_mla_inputs

pytestmark = pytest.mark.gpu(2)

S, N, H, T, D = 256, 2048, 128, 512, 576


@pytest.fixture(autouse=True)
def _needs_these_kernels():
    require_ffi_targets(FFI_TARGET, BWD_FFI_TARGET, BWD_BOUND_FFI_TARGET, BWD_FIXED_FFI_TARGET,
                        fixed_point.LIMBS_TO_FLOAT_TARGET)


def problem(tag):
    """q [S, H, D], kv [N, 1, D], adversarial indices [S, 1, T] (duplicates,
    out-of-range slots, some causally invisible), a static q_start."""
    return make_sparse_mla_inputs(seed_of("gpu-sharding", tag), S=S, H=H, D=D, N=N, T=T, dtype=jnp.bfloat16)


def kernel_calls(hlo: str, target: str) -> int:
    return len(re.findall(rf'custom_call_target="{target}"', hlo))


@pytest.mark.parametrize("axis", ["S", "H"])
def test_forward_sharded_gives_one_gpus_bits(axis):
    q, kv, idx, kw = problem(f"forward-{axis}")
    f = lambda q, kv, idx: sparse_mla(q, kv, idx, implementation="cuda", **kw)  # noqa: E731
    mesh = gpu_mesh(2)
    spec = P("x") if axis == "S" else P(None, "x")  # q [S, H, D], out [S, H, d_v], lse [S, H]
    sharded = jax.jit(f, in_shardings=(NamedSharding(mesh, spec), NamedSharding(mesh, P()),
                                       NamedSharding(mesh, P("x") if axis == "S" else P())),
                      out_shardings=NamedSharding(mesh, spec))
    want = jax.jit(f)(q, kv, idx)
    got = sharded(q, kv, idx)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    assert float(jnp.abs(want[0].astype(jnp.float32)).max()) > 0
    hlo = sharded.lower(q, kv, idx).compile().as_text()
    assert not collectives(hlo), collectives(hlo)
    assert kernel_calls(hlo, FFI_TARGET) == 1
    local = f"bf16[{S // 2},{H},{D}]" if axis == "S" else f"bf16[{S},{H // 2},{D}]"
    assert local in hlo and f"bf16[{S},{H},{D}]" not in hlo  # q exists per shard only


def sharded_grads(deterministic, mesh, spec):
    """jax.vjp of sparse_mla with q's rows (spec P("x")) or heads (P(None,
    "x")) and the cotangents sharded over ``mesh``, and unsharded."""
    def grads(q, kv, idx, dout, dlse, kw):
        fwd = lambda q, kv: sparse_mla(q, kv, idx, implementation="cuda", deterministic=deterministic,  # noqa: E731
                                       **kw)
        return jax.vjp(fwd, q, kv)[1]((dout, dlse))

    rows, whole = NamedSharding(mesh, spec), NamedSharding(mesh, P())
    idx_sharding = rows if spec == P("x") else whole

    def run(q, kv, idx, dout, dlse, kw):
        f = lambda *a: grads(*a, kw)  # noqa: E731
        sharded = jax.jit(f, in_shardings=(rows, whole, idx_sharding, rows, rows), out_shardings=(rows, whole))
        return sharded, jax.jit(f)
    return run


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_sequence_sharded(deterministic):
    """dq in one GPU's bits; dkv, float32: one GPU's up to the order of the
    all-reduce's sum; deterministic: one GPU's bits too (the shards share one
    fixed-point scale and add their integer sums exactly)."""
    q, kv, idx, kw = problem(f"backward-{deterministic}")
    dout, dlse = cotangents(seed_of("gpu-sharding-cotangents", deterministic), q)
    sharded, single = sharded_grads(deterministic, gpu_mesh(2), P("x"))(q, kv, idx, dout, dlse, kw)
    want = single(q, kv, idx, dout, dlse)
    dq, dkv = sharded(q, kv, idx, dout, dlse)
    assert same_bits(dq, want[0])
    assert float(jnp.abs(want[1].astype(jnp.float32)).max()) > 0
    if deterministic:
        assert same_bits(dkv, want[1])
    else:
        rel, mx = oracle.spec_errors(np.asarray(dkv, np.float32), np.asarray(want[1], np.float32))
        assert rel <= 4e-3 and mx <= 1e-2, (rel, mx)
    hlo = sharded.lower(q, kv, idx, dout, dlse).compile().as_text()
    reductions = re.findall(r"\ball-reduce(?:-start)?\(", hlo)
    assert collectives(hlo) == {"all-reduce"}, collectives(hlo)
    if deterministic:  # the scale words' max, then the limbs' and the flags' sums (XLA may combine those)
        assert 2 <= len(reductions) <= 3, len(reductions)
        assert kernel_calls(hlo, BWD_FFI_TARGET) == 0
        for target in (BWD_BOUND_FFI_TARGET, BWD_FIXED_FFI_TARGET, fixed_point.LIMBS_TO_FLOAT_TARGET):
            assert kernel_calls(hlo, target) == 1, target
        again = sharded(q, kv, idx, dout, dlse)
        assert same_bits(again[0], dq) and same_bits(again[1], dkv)
    else:
        assert len(reductions) == 1
        assert kernel_calls(hlo, BWD_FFI_TARGET) == 1


def test_backward_head_sharded_deterministic():
    """Heads over 2 GPUs: the same bits on every run, one GPU's values
    within float32 rounding (each 64-head half's terms are rounded to the
    fixed point apart, where one GPU first adds a head-tile pair's)."""
    q, kv, idx, kw = problem("backward-heads")
    dout, dlse = cotangents(seed_of("gpu-sharding-cotangents", "heads"), q)
    sharded, single = sharded_grads(True, gpu_mesh(2), P(None, "x"))(q, kv, idx, dout, dlse, kw)
    want = single(q, kv, idx, dout, dlse)
    dq, dkv = sharded(q, kv, idx, dout, dlse)
    for a, b in ((dq, want[0]), (dkv, want[1])):
        rel, mx = oracle.spec_errors(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert rel <= 4e-3 and mx <= 1e-2, (rel, mx)
    again = sharded(q, kv, idx, dout, dlse)
    assert same_bits(again[0], dq) and same_bits(again[1], dkv)
    assert kernel_calls(sharded.lower(q, kv, idx, dout, dlse).compile().as_text(), BWD_FIXED_FFI_TARGET) == 1


def test_backward_sequence_sharded_deterministic_non_finite():
    """A NaN in kv makes the whole kv gradient NaN, sharded as on one GPU
    (it enters every shard's bound), with the same bits."""
    q, kv, idx, kw = problem("backward-nan")
    kv = kv.at[7, 0, 3].set(jnp.nan)
    dout, dlse = cotangents(seed_of("gpu-sharding-cotangents", "nan"), q)
    sharded, single = sharded_grads(True, gpu_mesh(2), P("x"))(q, kv, idx, dout, dlse, kw)
    want = single(q, kv, idx, dout, dlse)
    got = sharded(q, kv, idx, dout, dlse)
    assert bool(jnp.isnan(want[1].astype(jnp.float32)).all())
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
