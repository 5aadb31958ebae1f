"""sparse_mla's gradients (SPEC §8.3) against the float64 oracle on the CPU:
cotangents on out and on lse (both bases), adversarial indices and rows
with no valid slot (zero gradients, never NaN), batches, packed rows, GQA,
the chunk loop and the deterministic mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inputs import seed_of
from jax_attn_dist import oracle, sparse_mla
from jax_attn_dist._core import checks
from jax_attn_dist.ops.sparse_mla.backward import sparse_mla_bwd_canonical
from sparse_mla_cases import make_sparse_mla_inputs, oracle_kwargs

F32 = jnp.float32
BF16 = jnp.bfloat16
ARRAYS = ("q_start_index", "topk_length", "cu_seqlens_q", "cu_seqlens_k")


def grads(q, kv, idx, kw, dout, dlse):
    """(out, lse, dq, dkv) of sparse_mla under jit, its array keywords traced."""
    kw = dict(kw)
    arrays = {n: kw.pop(n) for n in ARRAYS if n in kw and not isinstance(kw[n], (int, type(None)))}

    def f(q, kv, i, a, dout, dlse):
        (out, lse), vjp = jax.vjp(lambda q, kv: sparse_mla(q, kv, i, **kw, **a), q, kv)
        return (out, lse) + vjp((dout, dlse))

    return jax.jit(f)(q, kv, idx, arrays, dout, dlse)


def cotangents(seed, out_shape, lse_shape, dtype, ref_lse, lse_cot=True):
    """Random cotangents; dlse nonzero (large) also on rows of lse = -inf,
    which must not leak into the gradients."""
    rng = np.random.default_rng(seed)
    dout = jnp.asarray(rng.standard_normal(out_shape).astype(np.float32), dtype)
    dlse = rng.standard_normal(lse_shape).astype(np.float32) if lse_cot else np.zeros(lse_shape, np.float32)
    dlse_used = np.where(np.isneginf(ref_lse), 0.0, dlse)   # what the oracle sees
    dlse = np.where(np.isneginf(ref_lse), 1e30, dlse)        # what sparse_mla gets
    return dout, jnp.asarray(dlse, F32), dlse_used


def assert_close(got, want, name, tol):
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    assert np.isfinite(got).all(), f"{name}: non-finite gradient"
    assert np.abs(want).max() > 0, f"{name}: the reference is all 0 (degenerate test)"
    rel, mx = oracle.spec_errors(got, want)
    assert rel <= tol and mx <= tol, f"{name}: rel {rel:.2e}, max {mx:.2e} (tol {tol:g})"


def check_grads(q, kv, idx, kw, *, seed, dtype=F32, lse_cot=True, packing=None, tol=None):
    packing = packing or {}
    ref_out, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **oracle_kwargs(kw), **oracle_kwargs(packing))
    dout, dlse, dlse_used = cotangents(seed, ref_out.shape, ref_lse.shape, dtype, ref_lse, lse_cot)
    out, lse, dq, dkv = grads(q, kv, idx, dict(kw, **packing), dout, dlse)
    assert dq.dtype == q.dtype and dkv.dtype == kv.dtype
    want_dq, want_dkv = oracle.sparse_mla_grads_oracle(q, kv, idx, np.asarray(dout, np.float32), dlse_used,
                                                       **oracle_kwargs(kw), **oracle_kwargs(packing))
    # float32: float32-level; bf16: one rounding of each gradient to bf16
    tol = tol or (2e-5 if dtype == F32 else 2 ** -8)
    assert_close(dq, want_dq, "dq", tol)
    assert_close(dkv, want_dkv, "dkv", tol)
    empty = np.isneginf(ref_lse)
    assert np.all(np.asarray(dq, np.float32)[empty] == 0.0), "heads with no valid slot must get dq = 0"
    return ref_lse


@pytest.mark.parametrize("lse_base", ["2", "e"])
@pytest.mark.parametrize("lse_cot", [True, False], ids=["dout+dlse", "dout"])
def test_grads_match_oracle(lse_base, lse_cot):
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("grad", lse_base, lse_cot), B=2, S=6, H=3, D=12, N=14, T=9,
                                            d_v=8, dtype=F32, q_start_index="batch", lse_base=lse_base,
                                            empty_rows=0.2)
    ref_lse = check_grads(q, kv, idx, kw, seed=seed_of("cot", lse_base, lse_cot), lse_cot=lse_cot)
    assert np.isneginf(ref_lse).any()


def test_lse_cotangent_alone():
    """Only lse is used (dout = 0): dq and dkv come from P dlse_e alone."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("dlse"), S=5, H=2, D=8, N=9, T=6, d_v=4, dtype=F32)
    ref_out, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **oracle_kwargs(kw))
    dlse = np.where(np.isneginf(ref_lse), 0.0, np.random.default_rng(3).standard_normal(ref_lse.shape))

    def loss(q, kv):
        _, lse = sparse_mla(q, kv, idx, **kw)
        return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)

    dq, dkv = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)
    want = oracle.sparse_mla_grads_oracle(q, kv, idx, np.zeros(ref_out.shape), dlse, **oracle_kwargs(kw))
    assert_close(dq, want[0], "dq", 2e-5)
    assert_close(dkv, want[1], "dkv", 2e-5)


def test_bf16_adversarial_indices():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("grad-bf16"), S=6, H=5, D=16, N=12, T=10, d_v=16, dtype=BF16,
                                            causal=False, invalid_fraction=0.4, empty_rows=0.2)
    check_grads(q, kv, idx, kw, seed=seed_of("cot-bf16"), dtype=BF16)


def test_packed_and_topk_length_grads():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("grad-packed"), S=10, H=2, D=8, N=12, T=5, d_v=6, dtype=F32,
                                            indices="uniform")
    packing = dict(cu_seqlens_q=jnp.asarray([0, 4, 9], jnp.int32), cu_seqlens_k=jnp.asarray([0, 6, 12], jnp.int32),
                   topk_length=jnp.asarray(np.random.default_rng(2).integers(0, 7, (10,)), jnp.int32))
    check_grads(q, kv, idx, dict(kw, q_start_index=jnp.asarray([1, 0], jnp.int32)), seed=5, packing=packing)


def test_gqa_grads():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("grad-gqa"), B=2, S=4, H=4, HK=2, D=8, N=9, T=6, d_v=5,
                                            dtype=F32)
    check_grads(q, kv, idx, kw, seed=7)


def test_chunks_and_deterministic_mode_agree():
    """The backward's chunk loop (overlapping last chunk) and the sorted
    scatter of the deterministic mode give the one-chunk gradients."""
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("grad-chunks"), B=2, S=7, H=3, D=8, N=6, T=9, d_v=8, dtype=F32,
                                            q_start_index="batch")
    rng = np.random.default_rng(4)
    q_start = jnp.asarray(kw["q_start_index"])
    ranges = checks.no_row_ranges(2, 7)
    params = dict(sm_scale=kw["sm_scale"], causal=True, k_stride=1, lse_base="2", d_v=8)
    _, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **oracle_kwargs(kw))
    lse = jnp.asarray(ref_lse, F32)
    dout = jnp.asarray(rng.standard_normal((2, 7, 3, 8)), F32)
    dlse = jnp.asarray(rng.standard_normal((2, 7, 3)), F32)
    args = (q, kv, idx, q_start, ranges, lse, dout, dlse)
    one = jax.jit(lambda *a: sparse_mla_bwd_canonical(*a, deterministic=False, **params))(*args)
    for chunk, det in ((3, False), (None, True)):
        got = jax.jit(lambda *a: sparse_mla_bwd_canonical(*a, chunk=chunk, deterministic=det, **params))(*args)
        for a, b in zip(got, one):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_no_gradient_to_integer_arguments():
    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("grad-int"), S=3, H=2, D=8, N=5, T=4, d_v=8, dtype=F32)
    kw = dict(kw, q_start_index=jnp.int32(3))

    def loss(q, kv, idx, qs):
        out, lse = sparse_mla(q, kv, idx, **dict(kw, q_start_index=qs))
        return jnp.sum(out)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True))(q, kv, idx, kw["q_start_index"])
    assert g[2].dtype == jax.dtypes.float0 and g[3].dtype == jax.dtypes.float0
