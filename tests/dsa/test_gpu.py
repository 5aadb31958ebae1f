"""dsa_attention through the SM90 kernels against the jnp paths, on the GPU
(skipped elsewhere, see conftest.py; an extension without the ops' FFI
targets skips too, or fails under JAX_ATTN_DIST_REQUIRE_GPU).

At a moderate V3.2-like size (bf16, D = 576, d_v = 512, HI = 64, DI = 128):
the default lowering calls every op's kernel; the kernel's selection is
acceptable for the float64 logits (SPEC §9.3) and nearly always the XLA
path's; out, lse and the KL equal the jnp paths on the kernel's indices
(the two selections may differ at near-ties, so the comparison fixes
them); so do the gradients of ``sum(out * g) + mean(kl)``; and the
deterministic mode repeats bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_cases import check_selection, composed, layer_loss, make_dsa_inputs, split_arrays
from inputs import require_ffi_targets, seed_of
from jax_attn_dist import dsa_attention, oracle
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from jax_attn_dist.ops.sparse_mla import contract as mla_contract

pytestmark = pytest.mark.gpu

FORWARD_TARGETS = (topk_contract.FFI_TARGET, mla_contract.FFI_TARGET, attn_contract.FFI_TARGET,
                   indexer_contract.FWD_FFI_TARGET)
MODERATE = dict(B=2, S=256, N=1024, H=128, D=576, d_v=512, HI=64, DI=128, topk=512, dtype=jnp.bfloat16)


def out_shape():
    return tuple(MODERATE[k] for k in ("B", "S", "H", "d_v"))


@pytest.fixture(autouse=True)
def _needs_these_kernels():
    """The extension may predate an op: every forward FFI target must be registered."""
    require_ffi_targets(*FORWARD_TARGETS)


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
    assert f"@{indexer_contract.BWD_FFI_TARGET}(" in text
    # the sparse_mla backward kernel, where the op has one
    bwd = getattr(mla_contract, "BWD_FFI_TARGET", None)
    assert bwd is None or f"@{bwd}(" in text


def test_forward_matches_the_xla_path():
    arrays, kw, (static, traced) = inputs("forward")
    r = jax.jit(layer(static, traced))(*arrays)
    check_selection(r.indices, arrays, kw)
    xla_indices = jax.jit(layer(static, traced, implementation="xla"))(*arrays).indices
    same_rows = np.all(np.asarray(r.indices) == np.asarray(xla_indices), axis=(-2, -1))
    assert same_rows.mean() >= 0.9, f"only {same_rows.mean():.1%} of the rows select the XLA path's keys"
    want = jax.jit(lambda a, t, i: composed(*a, **static, **t, indices=i))(arrays, traced, r.indices)
    rel, mx = oracle.spec_errors(np.asarray(r.out, np.float32), np.asarray(want[0], np.float32))
    assert rel <= oracle.SPARSE_MLA_OUT_TOLERANCE and mx <= oracle.SPARSE_MLA_OUT_TOLERANCE, (rel, mx)
    lse, want_lse = np.asarray(r.lse), np.asarray(want[3])
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.abs(lse[finite] - want_lse[finite]).max() <= 2 * oracle.SPARSE_MLA_LSE_TOLERANCE
    oracle.assert_indexer_close(r.indexer_kl, want[1], tol=1e-3)
    assert float(np.asarray(r.indexer_kl).max()) > 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_match_the_xla_path(deterministic):
    arrays, kw, (static, traced) = inputs("grad", deterministic=deterministic)
    f = jax.jit(layer(static, traced))
    indices = f(*arrays).indices
    g = jnp.asarray(np.random.default_rng(1).standard_normal(out_shape()).astype(np.float32))
    got = layer_loss(f, g)(*arrays)
    want = layer_loss(lambda *a: composed(*a, **static, **traced, indices=indices), g)(*arrays)
    for name, a, b in zip(("q", "kv", "index_q", "index_k", "weights"), got, want):
        rel, mx = oracle.spec_errors(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert rel <= 2e-2 and mx <= 2e-2, f"d{name}: rel {rel:.2e}, max {mx:.2e}"
        assert float(jnp.abs(a.astype(jnp.float32)).max()) > 0, name
    if deterministic:
        again = layer_loss(f, g)(*arrays)
        for a, b in zip(got, again):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
