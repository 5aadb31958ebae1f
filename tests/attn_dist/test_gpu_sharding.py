"""Sharded runs with the CUDA kernel on 2+ GPUs equal the one-GPU result bit for bit.

Skipped unless there are at least 2 CUDA GPUs and the compiled extension is
registered. Each slot of the output is computed independently by the kernel,
so sequence (S) and head-group (H) sharding must not change a single bit; the
compiled program holds one per-shard kernel call on local shapes and no
all-gather of q (no collective at all).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_attn_dist import attn_dist
from jax_attn_dist.ops.attn_dist.contract import FFI_TARGET
from sharding_util import bits, collectives, gpu_mesh, mixed_synthetic_problem

pytestmark = pytest.mark.gpu(2)

S, N, H, T, D = 512, 4096, 128, 512, 576


def make_problem(seed, **kw):
    return mixed_synthetic_problem(seed, S=S, N=N, H=H, T=T, D=D, **kw)


def mesh2():
    return gpu_mesh(2)


def kernel_calls(hlo: str):
    """Result shapes of the jax_attn_dist_fwd custom calls in compiled HLO."""
    return re.findall(r"(f32\[[\d,]*\])\S* custom-call\([^\n]*custom_call_target=\"" + FFI_TARGET + '\\"', hlo)


def run(problem, in_specs, out_spec, mesh):
    kw = dict(sm_scale=problem.sm_scale, causal=problem.causal, k_stride=problem.k_stride,
              lse_base=problem.lse_base, implementation="cuda")
    f = lambda q, k, i, l, s: attn_dist(q, k, i, l, q_start_index=s, **kw)  # noqa: E731
    args = problem.arrays + (jnp.asarray(problem.q_start_index, jnp.int32),)
    one = jax.jit(f)
    ref = one(*args)
    assert len(kernel_calls(one.lower(*args).compile().as_text())) == 1
    sharded = jax.jit(
        f, in_shardings=tuple(NamedSharding(mesh, s) for s in in_specs),
        out_shardings=NamedSharding(mesh, out_spec),
    )
    out = sharded(*args)
    hlo = sharded.lower(*args).compile().as_text()
    return ref, out, hlo


def check_clean(hlo, q, q_local, out_local):
    assert not collectives(hlo), collectives(hlo)
    calls = kernel_calls(hlo)
    assert calls == ["f32[" + ",".join(map(str, out_local)) + "]"], calls
    assert "bf16[" + ",".join(map(str, q_local)) + "]" in hlo
    assert "bf16[" + ",".join(map(str, q.shape)) + "]" not in hlo  # q never whole


def test_sequence_sharded_over_2_gpus_bitwise():
    prob = make_problem(1)  # causal, unbatched
    mesh = mesh2()
    ref, out, hlo = run(prob, (P("x"), P(), P("x"), P("x"), P()), P(None, "x"), mesh)
    assert np.array_equal(bits(out), bits(ref))
    assert (np.asarray(ref) > 0).any() and (np.asarray(ref) == 0).any()
    check_clean(hlo, prob.q, (S // 2, H, D), (1, 2, S // 2, T))


def test_sequence_sharded_batched_per_batch_q_start_bitwise():
    prob = make_problem(2, B=2, k_stride=4, q_start_index=[4 * N - S, 3 * N])
    mesh = mesh2()
    ref, out, hlo = run(prob, (P(None, "x"), P(), P(None, "x"), P(None, "x"), P()), P(None, None, "x"), mesh)
    assert np.array_equal(bits(out), bits(ref))
    check_clean(hlo, prob.q, (2, S // 2, H, D), (2, 2, S // 2, T))


def test_head_sharded_over_2_gpus_bitwise():
    """H = 128 over 2 GPUs: one whole 64-head group each; the output's G follows."""
    prob = make_problem(3)
    mesh = mesh2()
    ref, out, hlo = run(prob, (P(None, "x"), P(), P(), P(None, "x"), P()), P("x"), mesh)
    assert np.array_equal(bits(out), bits(ref))
    check_clean(hlo, prob.q, (S, H // 2, D), (1, 1, S, T))


def test_shard_map_with_user_offsets_bitwise():
    prob = make_problem(4)
    mesh = mesh2()
    kw = dict(sm_scale=prob.sm_scale, causal=True, k_stride=1, lse_base=prob.lse_base, implementation="cuda")
    q_start = jnp.int32(prob.q_start_index)
    ref = jax.jit(lambda *a: attn_dist(*a, q_start_index=q_start, **kw))(*prob.arrays)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x"), P()),
                       out_specs=P(None, "x"))
    def per_shard(q, k, i, l, s):
        return attn_dist(q, k, i, l, q_start_index=s + jax.lax.axis_index("x") * (S // 2), **kw)

    f = jax.jit(per_shard)
    out = f(*prob.arrays, q_start)
    assert np.array_equal(bits(out), bits(ref))
    assert kernel_calls(f.lower(*prob.arrays, q_start).compile().as_text()) == [f"f32[1,2,{S // 2},{T}]"]
