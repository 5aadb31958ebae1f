"""dsa_attention on the jnp paths (SPEC §10): the selection, out, lse and KL
against a float64 evaluation, the same layer composed of the public ops,
gradients against float64 and their routing (out -> q, kv; KL -> the
indexer's inputs; nothing else), empty problems and input errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_cases import (check_forward_against_oracle, check_layer_grads, check_selection, composed, layer_grads_f64,
                       layer_loss, make_dsa_inputs, oracle_layer, sparse_mla_grads_f64, split_arrays)
from inputs import seed_of
from jax_attn_dist import DsaAttentionOutput, dsa_attention, oracle

SMALL = dict(S=12, N=20, H=4, D=24, HI=3, DI=16, topk=8, d_v=16)


def run(arrays, kw, **extra):
    static, traced = split_arrays(dict(kw, **extra))
    return jax.jit(lambda a, t: dsa_attention(*a, **static, **t))(arrays, traced)


@pytest.mark.parametrize("batched,dtype", [(False, jnp.float32), (True, jnp.float32), (True, jnp.bfloat16)],
                         ids=["unbatched", "batched-qstart-per-row", "bf16"])
def test_matches_float64(batched, dtype):
    arrays, kw = make_dsa_inputs(seed_of("dsa-f64", batched, str(dtype)), **SMALL, dtype=dtype,
                                 B=2 if batched else None, q_start_index="batch" if batched else None)
    r = run(arrays, kw)
    assert isinstance(r, DsaAttentionOutput)
    lead = (2,) if batched else ()
    assert r.out.shape == lead + (12, 4, 16) and r.out.dtype == dtype
    assert r.indexer_kl.shape == lead + (12,) and r.indices.shape == lead + (12, 1, 8) and r.lse.shape == lead + (12, 4)
    check_selection(r.indices, arrays, kw)
    assert (np.asarray(r.indices) == -1).any()  # rows that see fewer than topk keys
    out, lse, kl, _ = oracle_layer(arrays, r.indices, kw)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    rel, mx = oracle.spec_errors(np.asarray(r.out, np.float32), out)
    assert rel <= tol and mx <= tol, (rel, mx)
    np.testing.assert_allclose(np.asarray(r.lse), lse, atol=1e-4)
    oracle.assert_indexer_close(r.indexer_kl, kl)
    assert float(np.asarray(r.indexer_kl).max()) > 0


def test_equals_the_public_ops_composed():
    """indexer_topk, sparse_mla and indexer_loss called one after another."""
    arrays, kw = make_dsa_inputs(seed_of("dsa-composed"), **SMALL, B=2, q_start_index="batch")
    got = run(arrays, kw)
    static, traced = split_arrays(kw)
    want = jax.jit(lambda a, t: composed(*a, **static, **t))(arrays, traced)
    np.testing.assert_array_equal(got.indices, want[2])
    for a, b in zip((got.out, got.indexer_kl, got.lse), (want[0], want[1], want[3])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_gradients_match_float64():
    """d(sum(out * g) + mean(kl)): q and kv by SPEC §8.3 from `out` alone, the
    indexer's inputs by SPEC §5.3 with the float64 target."""
    arrays, kw = make_dsa_inputs(seed_of("dsa-grad"), **SMALL)
    r = run(arrays, kw)
    g = jnp.asarray(np.random.default_rng(3).standard_normal(r.out.shape).astype(np.float32))
    static, traced = split_arrays(kw)
    grads = layer_loss(lambda *a: dsa_attention(*a, **static, **traced), g)(*arrays)
    _, lse, _, target = oracle_layer(arrays, r.indices, kw)
    q, kv, iq, ik, w = arrays
    rule = dict(causal=True, q_start_index=kw["q_start_index"], k_stride=1)
    want_q = oracle.sparse_mla_grads_oracle(q, kv, r.indices, np.asarray(g), np.zeros_like(lse),
                                            sm_scale=kw["sm_scale"], d_v=kw["d_v"], lse_base="e", **rule)
    want_i = oracle.indexer_grads_oracle(iq, ik, w, r.indices, target, np.full((12,), 1 / 12),
                                         scale=kw["indexer_scale"], **rule)
    for name, got, want in zip(("q", "kv", "index_q", "index_k", "weights"), grads, want_q + want_i):
        rel, mx = oracle.spec_errors(np.asarray(got), want)
        assert rel <= 1e-4 and mx <= 1e-4, f"d{name}: rel {rel:.2e}, max {mx:.2e}"


def test_gradient_routing():
    """out reaches q and kv only; the KL the indexer's inputs only (its
    target is stop-gradient); lse q and kv only; all of them nonzero where
    they should be."""
    arrays, kw = make_dsa_inputs(seed_of("dsa-route"), **SMALL, B=2)
    static, traced = split_arrays(kw)
    f = lambda *a: dsa_attention(*a, **static, **traced)  # noqa: E731
    g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 12, 4, 16)).astype(np.float32))

    @jax.jit
    def grads(*a):  # one forward, three pullbacks
        (out, kl, lse), pull = jax.vjp(lambda *a: (lambda r: (r.out, r.indexer_kl, r.lse))(f(*a)), *a)
        return (pull((g, jnp.zeros_like(kl), jnp.zeros_like(lse))),
                pull((jnp.zeros_like(out), jnp.full_like(kl, 1 / kl.size), jnp.zeros_like(lse))),
                pull((jnp.zeros_like(out), jnp.zeros_like(kl), jnp.ones_like(lse))))

    from_out, from_kl, from_lse = grads(*arrays)
    for name, (via_out, via_kl, via_lse) in zip(("q", "kv", "index_q", "index_k", "weights"),
                                                zip(from_out, from_kl, from_lse)):
        attention = name in ("q", "kv")
        assert bool(jnp.any(via_out != 0)) == attention, name
        assert bool(jnp.any(via_lse != 0)) == attention, name
        assert bool(jnp.any(via_kl != 0)) != attention, name


def test_cuda_lowering_calls_each_kernel_once(cross_lowering):
    """Lowered for CUDA (no GPU needed): the forward calls the four ops'
    forward kernels once each; the gradient adds the backward kernels and
    recomputes no forward (the selection and the target are not
    differentiated)."""
    import collections
    import re

    from jax_attn_dist.ops.attn_dist import contract as attn_contract
    from jax_attn_dist.ops.indexer import contract as indexer_contract
    from jax_attn_dist.ops.indexer_topk import contract as topk_contract
    from jax_attn_dist.ops.sparse_mla import contract as mla_contract

    sds = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    args = (sds((64, 64, 576), bf16), sds((128, 1, 576), bf16), sds((64, 64, 128), bf16), sds((128, 128), bf16),
            sds((64, 64), jnp.float32))
    f = lambda *a: dsa_attention(*a, sm_scale=0.1, topk=64, q_start_index=64)  # noqa: E731

    def calls(fn):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return collections.Counter(re.findall(r"stablehlo\.custom_call @(\w+)\(", text))

    forward = {topk_contract.FFI_TARGET: 1, mla_contract.FFI_TARGET: 1, attn_contract.FFI_TARGET: 1,
               indexer_contract.FWD_FFI_TARGET: 1}
    assert calls(f) == forward
    backward = {indexer_contract.BWD_FFI_TARGET: 1, mla_contract.BWD_FFI_TARGET: 1}
    g = jnp.ones((64, 64, 512), jnp.float32)
    assert calls(layer_loss(f, g)) == {**forward, **backward}


def test_empty_problems():
    for S, N in ((0, 20), (12, 0)):
        arrays, kw = make_dsa_inputs(0, **dict(SMALL, S=S, N=N))
        r = dsa_attention(*arrays, **kw)
        assert r.out.shape == (S, 4, 16) and not np.asarray(r.out).any()
        assert r.indices.shape == (S, 1, 8) and (np.asarray(r.indices) == -1).all()
        assert np.isneginf(np.asarray(r.lse)).all() and not np.asarray(r.indexer_kl).any()


@pytest.mark.parametrize("S,N", [(12, 20), (0, 20), (12, 0)])
@pytest.mark.parametrize("q_start", ["int", "per-element"])
def test_empty_batch(S, N, q_start):
    """SPEC §10.1: B = 0 gives the results' shapes and dtypes (no error),
    eagerly and under jit, and gradients of the inputs' shapes."""
    arrays, kw = make_dsa_inputs(0, **dict(SMALL, S=S, N=N), B=0, dtype=jnp.bfloat16)
    if q_start == "per-element":
        kw["q_start_index"] = jnp.zeros((0,), jnp.int32)
    for r in (dsa_attention(*arrays, **kw), run(arrays, kw)):
        assert isinstance(r, DsaAttentionOutput)
        assert r.out.shape == (0, S, 4, 16) and r.out.dtype == jnp.bfloat16
        assert r.indexer_kl.shape == (0, S) and r.indexer_kl.dtype == jnp.float32
        assert r.indices.shape == (0, S, 1, 8) and r.indices.dtype == jnp.int32
        assert r.lse.shape == (0, S, 4) and r.lse.dtype == jnp.float32
    static, traced = split_arrays(kw)
    g = jnp.zeros((0, S, 4, 16), jnp.float32)
    grads = layer_loss(lambda *a: dsa_attention(*a, **static, **traced), g)(*arrays)
    for got, x in zip(grads, arrays):
        assert got.shape == x.shape and got.dtype == x.dtype


def test_kernel_checks_on_the_jnp_path():
    """test_gpu.py's checks of the kernels against float64 (SPEC §10.3: out
    and lse by §8.2, the KL by §3.2; dq and dkv by §8.3's accuracy, the
    indexer's gradients by §3.2's per-element bound), run on the jnp paths
    with bf16 inputs, the per-element q_start_index and rows that see one
    key or none: a correct implementation passes them. (At test_gpu.py's
    size, B = 2, S = 256, N = 1024, H = 128, D = 576, topk = 512, the jnp
    paths measured out 1.6e-3 / 2.0e-3, lse 8e-7, KL 8e-7, dq and dkv
    1.7e-3 / 2.3e-3, and 0.50, 0.20 and 0.002 of the indexer gradients'
    bounds.)"""
    arrays, kw = make_dsa_inputs(seed_of("dsa-kernel-checks"), B=2, S=40, N=160, H=16, D=64, d_v=32, HI=4, DI=16,
                                 topk=32, dtype=jnp.bfloat16, q_start_index="batch")
    static, traced = split_arrays(kw)
    f = jax.jit(lambda *a: dsa_attention(*a, **static, **traced, implementation="xla"))
    r = f(*arrays)
    check_selection(r.indices, arrays, kw)
    _, (_, _, _, target) = check_forward_against_oracle(r, arrays, kw)
    g = jnp.asarray(np.random.default_rng(5).standard_normal(r.out.shape).astype(np.float32))
    grads = layer_loss(f, g)(*arrays)
    check_layer_grads(grads, arrays, layer_grads_f64(arrays, kw, r.indices, g, target))


@pytest.mark.parametrize("q_start", ["int", "per-element"])
def test_float64_gradients_equal_the_oracle(q_start):
    """dsa_cases.sparse_mla_grads_f64 (test_gpu.py's dq and dkv reference,
    in matrix products) equals oracle.sparse_mla_grads_oracle, with
    duplicated, invalid and causally masked slots and empty rows."""
    from sparse_mla_cases import make_sparse_mla_inputs

    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("dsa-f64-grads", q_start), B=2, S=20, H=6, D=40, N=30, T=24,
                                            q_start_index=None if q_start == "int" else "batch",
                                            lse_base="e", empty_rows=0.2)
    dout = np.random.default_rng(7).standard_normal(q.shape[:-1] + (kw["d_v"],))
    rule = dict(causal=kw["causal"], q_start_index=np.asarray(kw["q_start_index"]), k_stride=kw["k_stride"])
    want = oracle.sparse_mla_grads_oracle(q, kv, idx, dout, np.zeros(q.shape[:-1]), sm_scale=kw["sm_scale"],
                                          d_v=kw["d_v"], lse_base="e", **rule)
    got = sparse_mla_grads_f64(q, kv, idx, dout, sm_scale=kw["sm_scale"], d_v=kw["d_v"], rows=7, **rule)
    for a, b in zip(got, want):
        assert a.shape == b.shape and np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * np.abs(b).max())


def _bad(arrays, kw, i, x):
    arrays = list(arrays)
    arrays[i] = x
    return arrays, kw


ARRAYS, KW = make_dsa_inputs(1, **SMALL)
Q, KV, IQ, IK, W = ARRAYS
BAD = {
    "q not an array": (TypeError, "`q` must be an array", _bad(ARRAYS, KW, 0, [1.0])),
    "index_q batched, q not": (ValueError, "`index_q` must have rank 3", _bad(ARRAYS, KW, 2, IQ[None])),
    "index_q other S": (ValueError, "`index_q` must have the query rows of `q`", _bad(ARRAYS, KW, 2, IQ[:5])),
    "kv two heads": (ValueError, "`kv` must have one kv head", _bad(ARRAYS, KW, 1, jnp.concatenate([KV, KV], 1))),
    "index_k other N": (ValueError, "`kv` and `index_k` must hold the same keys", _bad(ARRAYS, KW, 3, IK[:7])),
    "kv other dtype": (TypeError, "`q` and `kv` must have the same dtype", _bad(ARRAYS, KW, 1, KV.astype(jnp.bfloat16))),
    "kv other D": (ValueError, "D", _bad(ARRAYS, KW, 1, KV[..., :8])),
    "weights other HI": (ValueError, "`weights` must have shape", _bad(ARRAYS, KW, 4, W[:, :2])),
    "fp8 index_q": (TypeError, "`index_q` and `index_k`", (
        [Q, KV, IQ.astype(jnp.float8_e4m3fn), IK.astype(jnp.float8_e4m3fn), W], KW)),
    "topk 0": (ValueError, "`topk` must be an int >= 1", (ARRAYS, dict(KW, topk=0))),
    "topk float": (TypeError, "`topk` must be a Python int", (ARRAYS, dict(KW, topk=8.0))),
    "indexer_scale 0": (ValueError, "`indexer_scale` must be a finite positive", (ARRAYS, dict(KW, indexer_scale=0.0))),
    "sm_scale missing": (TypeError, "`sm_scale` must be a Python float", (ARRAYS, dict(KW, sm_scale=None))),
    "d_v too wide": (ValueError, "`d_v`", (ARRAYS, dict(KW, d_v=25))),
    "k_stride 0": (ValueError, "`k_stride` must be an int >= 1", (ARRAYS, dict(KW, k_stride=0))),
    "deterministic not bool": (TypeError, "`deterministic` must be a bool", (ARRAYS, dict(KW, deterministic=1))),
    "implementation": (ValueError, "`implementation` must be None", (ARRAYS, dict(KW, implementation="tpu"))),
    "cuda on float32": (ValueError, "implementation='cuda' cannot serve this call", (ARRAYS, dict(KW, implementation="cuda"))),
    "q_start_index per row, unbatched": (ValueError, "`q_start_index` must be a scalar",
                                         (ARRAYS, dict(KW, q_start_index=jnp.zeros((12,), jnp.int32)))),
    "cu_seqlens_q alone": (ValueError, "`cu_seqlens_q` was given without `cu_seqlens_k`",
                           (ARRAYS, dict(KW, cu_seqlens_q=jnp.asarray([0, 12], jnp.int32)))),
}


@pytest.mark.parametrize("case", list(BAD))
def test_input_errors(case):
    kind, words, (arrays, kw) = BAD[case]
    with pytest.raises(kind, match="^dsa_attention: ") as e:
        jax.eval_shape(lambda *a: dsa_attention(*a, **kw), *arrays) if case != "q not an array" else \
            dsa_attention(*arrays, **kw)
    assert words in str(e.value), str(e.value)
