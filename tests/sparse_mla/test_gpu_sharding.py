"""sparse_mla with the CUDA kernels sharded over 2 GPUs (skipped unless there
are at least 2 CUDA GPUs and the compiled extension registers the kernels,
see conftest.py).

The forward computes each (row, head) from its own slots, so S and H
sharding give one GPU's bits, with one per-shard kernel call and no
collective. The backward with S sharded gives each row's dq in one GPU's
bits; each shard's kv gradient is the partial sum over its rows, added by
one all-reduce, so dkv equals one GPU's up to the float32 order of that
sum; the deterministic mode repeats its bits on the mesh (SPEC §8.3)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from inputs import require_ffi_targets, seed_of
from jax_attn_dist import oracle, sparse_mla
from jax_attn_dist.ops.sparse_mla.contract import BWD_FFI_TARGET, FFI_TARGET
from sharding_util import collectives, gpu_mesh, same_bits
from sparse_mla_cases import cotangents, make_sparse_mla_inputs

pytestmark = pytest.mark.gpu(2)

S, N, H, T, D = 256, 2048, 128, 512, 576


@pytest.fixture(autouse=True)
def _needs_these_kernels():
    require_ffi_targets(FFI_TARGET, BWD_FFI_TARGET)


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


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_sequence_sharded(deterministic):
    q, kv, idx, kw = problem(f"backward-{deterministic}")
    dout, dlse = cotangents(seed_of("gpu-sharding-cotangents", deterministic), q)

    def grads(q, kv, idx, dout, dlse):
        fwd = lambda q, kv: sparse_mla(q, kv, idx, implementation="cuda", deterministic=deterministic,  # noqa: E731
                                       **kw)
        return jax.vjp(fwd, q, kv)[1]((dout, dlse))

    mesh = gpu_mesh(2)
    rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    sharded = jax.jit(grads, in_shardings=(rows, whole, rows, rows, rows), out_shardings=(rows, whole))
    want = jax.jit(grads)(q, kv, idx, dout, dlse)
    dq, dkv = sharded(q, kv, idx, dout, dlse)
    assert same_bits(dq, want[0])
    rel, mx = oracle.spec_errors(np.asarray(dkv, np.float32), np.asarray(want[1], np.float32))
    assert rel <= 4e-3 and mx <= 1e-2, (rel, mx)
    assert float(jnp.abs(want[1].astype(jnp.float32)).max()) > 0
    hlo = sharded.lower(q, kv, idx, dout, dlse).compile().as_text()
    reductions = re.findall(r"\ball-reduce(?:-start)?\(", hlo)
    assert len(reductions) == 1 and collectives(hlo) == {"all-reduce"}, collectives(hlo)
    assert kernel_calls(hlo, BWD_FFI_TARGET) == 1
    if deterministic:
        again = sharded(q, kv, idx, dout, dlse)
        assert same_bits(again[0], dq) and same_bits(again[1], dkv)
