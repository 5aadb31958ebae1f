"""dsa_attention through the SM90 kernels against float64, on the GPU
(skipped elsewhere, see conftest.py; an extension without the ops' FFI
targets skips too, or fails under JAX_ATTN_DIST_REQUIRE_GPU).

At a moderate V3.2-like size (bf16, D = 576, d_v = 512, HI = 64, DI = 128):
the default lowering calls every op's kernel; the kernel's selection is
acceptable for the float64 logits (SPEC §9.3) and nearly always the XLA
path's; out, lse and the KL meet their ops' contracts against the float64
oracle on the kernel's own indices (SPEC §10.3: §8.2 and §3.2); the
gradients of ``sum(out * g) + mean(kl)`` meet SPEC §8.3's accuracy (dq,
dkv) and §3.2's per-element bound (the indexer's inputs) against float64;
and the deterministic mode repeats bit for bit. (The same checks run on the
jnp paths on the CPU: test_api.py's ``test_kernel_checks_on_the_jnp_path``.)
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_cases import (check_forward_against_oracle, check_layer_grads, check_selection, layer_grads_f64, layer_loss,
                       make_dsa_inputs, oracle_layer, split_arrays)
from inputs import require_ffi_targets, seed_of
from jax_attn_dist import dsa_attention
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from jax_attn_dist.ops.sparse_mla import contract as mla_contract

pytestmark = pytest.mark.gpu

FORWARD_TARGETS = (topk_contract.FFI_TARGET, mla_contract.FFI_TARGET, attn_contract.FFI_TARGET,
                   indexer_contract.FWD_FFI_TARGET)
BACKWARD_TARGETS = (mla_contract.BWD_FFI_TARGET, indexer_contract.BWD_FFI_TARGET)
MODERATE = dict(B=2, S=256, N=1024, H=128, D=576, d_v=512, HI=64, DI=128, topk=512, dtype=jnp.bfloat16)


def out_shape():
    return tuple(MODERATE[k] for k in ("B", "S", "H", "d_v"))


@pytest.fixture(autouse=True)
def _needs_these_kernels():
    """The extension may predate an op: every FFI target the layer uses must be registered."""
    require_ffi_targets(*FORWARD_TARGETS, indexer_contract.BWD_FFI_TARGET, mla_contract.BWD_FFI_TARGET)


def inputs(tag, **extra):
    arrays, kw = make_dsa_inputs(seed_of("dsa-gpu", tag), **MODERATE, q_start_index="batch")
    kw.update(extra)
    return arrays, kw, split_arrays(kw)


def layer(static, traced, **extra):
    return lambda *a: dsa_attention(*a, **static, **traced, **extra)


def test_default_lowering_calls_every_kernel():
    arrays, _, (static, traced) = inputs("lowering")
    forward = jax.jit(layer(static, traced)).lower(*arrays).as_text()
    for target in FORWARD_TARGETS:
        assert f"@{target}(" in forward, target
    g = jnp.ones(out_shape(), jnp.float32)
    text = layer_loss(layer(static, traced), g).lower(*arrays).as_text()
    for target in BACKWARD_TARGETS:
        assert f"@{target}(" in text, target


def test_vmap_equals_the_batched_call():
    """vmap over the batch folds into the kernels' batch (every op's kernel
    in the lowering): the batched call's bits."""
    arrays, _, (static, traced) = inputs("vmap")
    batched = jax.jit(layer(static, traced))
    mapped = jax.jit(jax.vmap(lambda a, s: dsa_attention(*a, **static, q_start_index=s)))
    text = mapped.lower(arrays, traced["q_start_index"]).as_text()
    for target in FORWARD_TARGETS:
        assert f"@{target}(" in text, target
    want, got = batched(*arrays), mapped(arrays, traced["q_start_index"])
    for name, a, b in zip(want._fields, got, want):
        assert a.shape == b.shape and np.asarray(a).tobytes() == np.asarray(b).tobytes(), name


def test_forward_matches_float64():
    arrays, kw, (static, traced) = inputs("forward")
    r = jax.jit(layer(static, traced))(*arrays)
    check_selection(r.indices, arrays, kw)
    xla_indices = jax.jit(layer(static, traced, implementation="xla"))(*arrays).indices
    same_rows = np.all(np.asarray(r.indices) == np.asarray(xla_indices), axis=(-2, -1))
    assert same_rows.mean() >= 0.9, f"only {same_rows.mean():.1%} of the rows select the XLA path's keys"
    check_forward_against_oracle(r, arrays, kw)


_REFERENCE = {}


def float64_gradients(arrays, kw, indices, g):
    """layer_grads_f64 on the layer's indices, once per selection (both
    modes select alike: the float64 work is shared)."""
    key = hashlib.sha256(np.asarray(indices).tobytes()).hexdigest()
    if key not in _REFERENCE:
        target = oracle_layer(arrays, np.asarray(indices), kw)[3]
        _REFERENCE[key] = layer_grads_f64(arrays, kw, indices, g, target)
    return _REFERENCE[key]


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_match_float64(deterministic):
    arrays, kw, (static, traced) = inputs("grad", deterministic=deterministic)
    f = jax.jit(layer(static, traced))
    indices = np.asarray(f(*arrays).indices)
    check_selection(indices, arrays, kw)
    g = jnp.asarray(np.random.default_rng(1).standard_normal(out_shape()).astype(np.float32))
    got = layer_loss(f, g)(*arrays)
    check_layer_grads(got, arrays, float64_gradients(arrays, kw, indices, g))
    if deterministic:
        again = layer_loss(f, g)(*arrays)
        for a, b in zip(got, again):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
