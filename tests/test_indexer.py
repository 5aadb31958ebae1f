"""indexer_kl and indexer_loss on the jnp path (any backend): against the
float64 oracle (SPEC §5), gradients, vmap, empty and bad inputs, the CUDA
lowering, export."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from grad_util import assert_grad_close, plain_indexer_kl
from inputs import INT32_MAX, INT32_MIN, make_indexer_inputs, seed_of
from jax_attn_dist._core import checks, ext
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist import (
    attn_dist,
    indexer_kernel_supports,
    indexer_kl,
    indexer_kl_p,
    indexer_kl_reference,
    indexer_loss,
    oracle,
    synthetic,
)
from jax_attn_dist._core.chunks import sorted_segment_scatter_add
from jax_attn_dist.ops.indexer.reference import indexer_reference_canonical
from jaxpr_util import iter_eqns

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def run(fn, iq, ik, w, idx, tgt, kw, **extra):
    """``fn`` under jit with q_start_index traced."""
    kw = dict(kw, **extra)
    qs = kw.pop("q_start_index")
    return jax.jit(lambda a, b, c, d, e, s: fn(a, b, c, d, e, q_start_index=s, **kw))(
        iq, ik, w, idx, tgt, jnp.asarray(qs, jnp.int32))


# A matrix crossing HI, DI, dtype, batch, causal, k_stride, q_start kinds.
_CASES = []
for n, (HI, DI) in enumerate(itertools.product((1, 16, 64, 5), (64, 128, 16))):
    dtype = (BF16, F16, F32)[n % 3]
    wdt = (F32, BF16)[n % 2]
    B = (None, 2, 3)[n % 3]
    causal = n % 4 != 3
    ks = (1, 2, 4)[n % 3]
    qs = "batch" if B and n % 2 else None
    _CASES.append(dict(HI=HI, DI=DI, dtype=dtype, weights_dtype=wdt, B=B, causal=causal, k_stride=ks, q_start_index=qs))


def _cid(c):
    return "HI{HI}-DI{DI}-{dt}-w{wdt}-B{B}-{c}-ks{k_stride}-{qs}".format(
        dt=jnp.dtype(c["dtype"]).name, wdt=jnp.dtype(c["weights_dtype"]).name, c="causal" if c["causal"] else "full",
        qs=c["q_start_index"] or "int", **{k: v for k, v in c.items() if k in ("HI", "DI", "B", "k_stride")})


@pytest.mark.parametrize("case", _CASES, ids=[_cid(c) for c in _CASES])
def test_matches_float64(case):
    seed = seed_of("indexer", _cid(case))
    S, N, T = 19, 37, 24
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed, S=S, N=N, T=T, **case)
    got = np.asarray(run(indexer_kl, iq, ik, w, idx, tgt, kw))
    want = oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **kw)
    lead = (case["B"],) if case["B"] else ()
    assert got.shape == lead + (S,) and got.dtype == np.float32
    oracle.assert_indexer_close(got, want)
    assert np.abs(want).max() > 0.01  # not a degenerate case
    # the reference entry point agrees (same code path, other front door)
    ref = np.asarray(run(indexer_kl_reference, iq, ik, w, idx, tgt, kw))
    np.testing.assert_array_equal(got, ref)


def test_special_rows_are_exactly_zero():
    """All-invalid rows, all-zero target rows and rows whose target sits only
    on invalid slots give exactly 0; mass on invalid slots is ignored."""
    S, N, T, HI, DI = 6, 10, 8, 4, 16
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-special"), S=S, HI=HI, DI=DI, N=N, T=T,
                                                  causal=False, zero_rows=0.0, invalid_fraction=0.0)
    idx, tgt = np.array(idx), np.array(tgt)
    idx[0] = [INT32_MIN, -1, N, N + 1, INT32_MAX, -7, N * 3, -(2**30)]  # row 0: no valid slot
    tgt[1] = 0.0                                                        # row 1: no target
    tgt[2, :4] = 0.0
    idx[2, 0, 4:] = -1                                                  # row 2: target only on invalid slots
    tgt_moved = tgt.copy()
    tgt_moved[3, 0] += 5.0
    idx[3, 0, 0] = N                                                    # row 3: extra mass on an invalid slot
    got = np.asarray(indexer_kl(iq, ik, w, jnp.asarray(idx), jnp.asarray(tgt), **kw))
    assert got[0] == 0.0 and got[1] == 0.0 and got[2] == 0.0
    moved = np.asarray(indexer_kl(iq, ik, w, jnp.asarray(idx), jnp.asarray(tgt_moved), **kw))
    assert moved[3] == got[3]
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **kw))
    g = jax.grad(lambda a, b, c: indexer_kl(a, b, c, jnp.asarray(idx), jnp.asarray(tgt), **kw)[:3].sum(),
                 argnums=(0, 1, 2))(iq, ik, w)
    for x in g:
        assert np.all(np.asarray(x, np.float32) == 0.0)


def test_large_logits_stay_accurate():
    """Logits in the hundreds: the KL is formed around the row maximum."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-large"), S=8, HI=16, DI=64, N=50, T=32,
                                                  dtype=F32, scale=300.0)
    got = indexer_kl(iq, ik, w, idx, tgt, **kw)
    want = oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **kw)
    oracle.assert_indexer_close(got, want)


@pytest.mark.parametrize("chunk", [1, 3, 7, 40])
def test_chunk_loop(chunk):
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-chunk"), B=2, S=9, HI=8, DI=16, N=20, T=12,
                                                  q_start_index="batch", dtype=F32)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    params = dict(scale=kw["scale"], causal=kw["causal"], k_stride=kw["k_stride"])
    none = checks.no_row_ranges(2, 9)
    whole = indexer_reference_canonical(iq, ik, w, idx, tgt, qs, none, **params)
    part = jax.jit(lambda *a: indexer_reference_canonical(*a, chunk=chunk, **params))(iq, ik, w, idx, tgt, qs, none)
    for a, b in zip(part, whole):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_empty_problems():
    for S, T, N in [(0, 4, 5), (3, 0, 5), (3, 4, 0)]:
        iq = jnp.ones((S, 2, 16), BF16)
        ik = jnp.ones((N, 16), BF16)
        w = jnp.ones((S, 2), F32)
        idx = jnp.zeros((S, 1, T), jnp.int32)
        tgt = jnp.ones((S, T), F32)
        out = indexer_kl(iq, ik, w, idx, tgt)
        assert out.shape == (S,) and np.all(np.asarray(out) == 0)
        g = jax.grad(lambda a, c: indexer_kl(a, ik, c, idx, tgt).sum(), argnums=(0, 1))(iq, w)
        assert all(np.all(np.asarray(x, np.float32) == 0) for x in g)
    out = indexer_kl(jnp.ones((0, 3, 2, 16), BF16), jnp.ones((0, 5, 16), BF16), jnp.ones((0, 3, 2), F32),
                     jnp.zeros((0, 3, 1, 4), jnp.int32), jnp.ones((0, 3, 4), F32))
    assert out.shape == (0, 3)


# ----------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,B,causal,k_stride,deterministic", [
    (F32, None, True, 1, False),
    (F32, 2, True, 2, True),
    (BF16, 2, False, 1, False),
    (F16, None, True, 4, True),
])
def test_gradients_match_plain_jax_grad_and_float64(dtype, B, causal, k_stride, deterministic):
    seed = seed_of("indexer-grad", jnp.dtype(dtype).name, B, causal, k_stride, deterministic)
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed, B=B, S=11, HI=6, DI=16, N=15, T=10, dtype=dtype,
                                                  causal=causal, k_stride=k_stride,
                                                  q_start_index="batch" if B else None)
    rng = np.random.default_rng(seed)
    g = jnp.asarray(rng.standard_normal(idx.shape[:-2]), F32)

    def loss(fn, a, b, c, **extra):
        return jnp.sum(g * fn(a, b, c, idx, tgt, **kw, **extra))

    got = jax.jit(jax.grad(lambda a, b, c: loss(indexer_kl, a, b, c, deterministic=deterministic),
                           argnums=(0, 1, 2)))(iq, ik, w)
    plain = jax.grad(lambda a, b, c: loss(plain_indexer_kl, a, b, c), argnums=(0, 1, 2))(
        iq.astype(F32), ik.astype(F32), w.astype(F32))
    want = oracle.indexer_grads_oracle(iq, ik, w, idx, tgt, g, **kw)
    # float32 sums of cancelling terms (softmax * tau - t): errors scale with the largest gradient
    rtol, atol_frac = (2e-5, 2e-6) if dtype == F32 else (1e-2, 1e-3)  # gradients come back in the input dtype
    for name, a, p, o, x in zip(("d_index_q", "d_index_k", "d_weights"), got, plain, want, (iq, ik, w)):
        assert a.dtype == x.dtype, name
        assert_grad_close(a, o, name + " vs float64", rtol, atol_frac)
        assert_grad_close(a, p, name + " vs jax.grad", rtol, atol_frac)


def test_target_gets_a_zero_cotangent_and_integers_none():
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-cot"), S=5, HI=4, DI=16, N=9, T=6, dtype=F32)
    d_tgt = jax.grad(lambda t: indexer_kl(iq, ik, w, idx, t, **kw).sum())(tgt)
    assert np.all(np.asarray(d_tgt) == 0)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    grads = jax.grad(lambda i, s: indexer_kl(iq, ik, w, i, tgt, q_start_index=s, **kw).sum(),
                     argnums=(0, 1), allow_int=True)(idx, qs)
    assert all(x.dtype == jax.dtypes.float0 for x in grads)


def test_deterministic_scatter_equals_scatter_add():
    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.integers(0, 12, 300).astype(np.int32).tolist() + [12, 40], jnp.int32)  # last two dropped
    vals = jnp.asarray(rng.standard_normal((302, 5)), F32)
    acc = jnp.asarray(rng.standard_normal((12, 5)), F32)
    got = sorted_segment_scatter_add(acc, keys, vals, num_keys=12)
    want = acc.at[keys].add(vals, mode="drop")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_backward_is_one_partitionable_primitive():
    """The backward binds indexer_kl_bwd (no [B, S, HI, T] residual: the
    forward saves only its inputs and the per-row lse)."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-jaxpr"), S=5, HI=4, DI=16, N=9, T=6)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a: indexer_kl(a, ik, w, idx, tgt, **kw).sum()))(iq)
    names = [e.primitive.name for e in iter_eqns(jaxpr.jaxpr)]
    assert names.count("indexer_kl_bwd") == 1 and "indexer_kl" in names
    fwd_res = jax.make_jaxpr(lambda a: jax.vjp(lambda x: indexer_kl(x, ik, w, idx, tgt, **kw), a)[1])(iq)
    shapes = {tuple(v.aval.shape) for v in fwd_res.jaxpr.outvars if hasattr(v.aval, "shape")}
    assert (5, 4, 6) not in shapes and (1, 5, 4, 6) not in shapes


# ----------------------------------------------------------------------------
# vmap
# ----------------------------------------------------------------------------


def test_vmap_equals_loop_with_one_bind():
    V = 3
    sets = [make_indexer_inputs(seed_of("indexer-vmap", v), B=2, S=6, HI=4, DI=16, N=9, T=7, dtype=F32,
                                q_start_index="batch") for v in range(V)]
    stack = [jnp.stack([s[i] for s in sets]) for i in range(5)]
    qs = jnp.stack([jnp.asarray(s[5]["q_start_index"], jnp.int32) for s in sets])
    kw = {k: v for k, v in sets[0][5].items() if k != "q_start_index"}
    f = lambda a, b, c, d, e, s: indexer_kl(a, b, c, d, e, q_start_index=s, **kw)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.vmap(f))(*stack, qs)
    assert sum(e.primitive is indexer_kl_p for e in iter_eqns(jaxpr.jaxpr)) == 1
    got = np.asarray(jax.jit(jax.vmap(f))(*stack, qs))
    for v in range(V):
        np.testing.assert_allclose(got[v], np.asarray(jax.jit(f)(*(x[v] for x in stack), qs[v])), rtol=1e-6,
                                   atol=1e-6)
    # gradients under vmap (the backward primitive's batching rule)
    gv = jax.jit(jax.vmap(jax.grad(lambda a, b, c, d, e, s: f(a, b, c, d, e, s).sum(), argnums=(0, 1, 2))))(
        *stack, qs)
    for v in range(V):
        gl = jax.grad(lambda a, b, c: f(a, b, c, stack[3][v], stack[4][v], qs[v]).sum(), argnums=(0, 1, 2))(
            stack[0][v], stack[1][v], stack[2][v])
        for a, b in zip(gv, gl):
            np.testing.assert_allclose(a[v], b, rtol=1e-5, atol=1e-6)


def test_vmap_of_unbatched_with_shared_index_k():
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-vmap-shared"), B=3, S=5, HI=4, DI=16, N=8, T=6,
                                                  dtype=F32)
    got = jax.vmap(lambda a, c, d, e: indexer_kl(a, ik[0], c, d, e, **kw))(iq, w, idx, tgt)
    for b in range(3):
        np.testing.assert_allclose(got[b], indexer_kl(iq[b], ik[0], w[b], idx[b], tgt[b], **kw), rtol=1e-6,
                                   atol=1e-6)


# ----------------------------------------------------------------------------
# indexer_loss
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("lse_base,B", [("2", None), ("e", 2)])
def test_indexer_loss_equals_indexer_kl_on_the_hand_made_target(lse_base, B):
    p = synthetic.make_problem(S=12, N=30, H=70, T=8, D=32, B=B, lse_base=lse_base, seed=4)
    ix = synthetic.make_indexer(p, HI=8, DI=16, seed=4)
    kw = p.kwargs
    got = indexer_loss(p.q, p.k, p.lse, *ix.arrays, p.indices, scale=0.7, **kw)
    dist = attn_dist(*p.arrays, **kw)
    mass = dist.sum(axis=-3)
    total = mass.sum(-1, keepdims=True)
    target = jnp.where(total > 0, mass / jnp.where(total > 0, total, 1), 0.0)
    want = indexer_kl(*ix.arrays, p.indices, target, scale=0.7, causal=kw["causal"],
                      q_start_index=kw["q_start_index"], k_stride=kw["k_stride"])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # against float64 end to end
    ref_dist = oracle.attn_dist_oracle(*p.arrays, **kw)
    m64 = ref_dist.sum(axis=-3)
    t64 = m64 / np.where(m64.sum(-1, keepdims=True) > 0, m64.sum(-1, keepdims=True), 1)
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(*ix.arrays, p.indices, t64, scale=0.7,
                                                              causal=kw["causal"], q_start_index=kw["q_start_index"],
                                                              k_stride=kw["k_stride"]))
    # no gradient reaches the main attention's inputs
    gq, gk, gl = jax.grad(lambda q, k, l: indexer_loss(q, k, l, *ix.arrays, p.indices, **kw).sum(),
                          argnums=(0, 1, 2))(p.q, p.k, p.lse)
    assert all(np.all(np.asarray(x, np.float32) == 0) for x in (gq, gk, gl))


# ----------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------


def _good(batched=False):
    lead = (2,) if batched else ()
    return dict(
        index_q=jnp.zeros(lead + (5, 4, 16), BF16), index_k=jnp.zeros(lead + (7, 16), BF16),
        weights=jnp.zeros(lead + (5, 4), F32), indices=jnp.zeros(lead + (5, 1, 3), jnp.int32),
        target=jnp.zeros(lead + (5, 3), F32),
    )


BAD = [
    ("index_q rank", dict(index_q=jnp.zeros((5, 4), BF16)), ValueError, "`index_q` must have rank 3"),
    ("index_k DI", dict(index_k=jnp.zeros((7, 8), BF16)), ValueError, "`index_k` must have shape .*DI = 16"),
    ("index_k dtype", dict(index_k=jnp.zeros((7, 16), F32)), TypeError, "`index_q` and `index_k` must have the same dtype"),
    ("index_q dtype", dict(index_q=jnp.zeros((5, 4, 16), jnp.int8)), TypeError, "`index_q` and `index_k` must have the same dtype"),
    ("weights shape", dict(weights=jnp.zeros((5, 3), F32)), ValueError, r"`weights` must have shape \[S, HI\]"),
    ("weights dtype", dict(weights=jnp.zeros((5, 4), F16)), TypeError, "`weights` must have dtype float32 or"),
    ("indices HK", dict(indices=jnp.zeros((5, 2, 3), jnp.int32)), ValueError, r"`indices` must have shape \[S, 1, T\]"),
    ("indices dtype", dict(indices=jnp.zeros((5, 1, 3), jnp.int64 if jax.config.x64_enabled else jnp.int16)),
     TypeError, "`indices` must have dtype int32"),
    ("target shape", dict(target=jnp.zeros((5, 4), F32)), ValueError, r"`target` must have shape \[S, T\]"),
    ("target dtype", dict(target=jnp.zeros((5, 3), BF16)), TypeError, "`target` must have dtype float32"),
    ("rank mix", dict(index_k=jnp.zeros((2, 7, 16), BF16)), ValueError, "`index_k` must have rank 2"),
    ("not an array", dict(target=[[0.0]]), TypeError, "`target` must be an array"),
]


@pytest.mark.parametrize("name,change,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, change, exc, msg):
    args = dict(_good(), **change)
    with pytest.raises(exc, match="indexer_kl: " + msg):
        indexer_kl(**args)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(scale=0.0), ValueError, "`scale` must be a finite positive"),
    (dict(scale=float("inf")), ValueError, "`scale` must be a finite positive"),
    (dict(scale=jnp.float32(1.0)), TypeError, "`scale` must be a Python float"),
    (dict(k_stride=0), ValueError, "`k_stride` must be an int >= 1"),
    (dict(causal=1), TypeError, "`causal` must be a bool"),
    (dict(deterministic="yes"), TypeError, "`deterministic` must be a bool"),
    (dict(implementation="tpu"), ValueError, "`implementation` must be None"),
    (dict(q_start_index=jnp.zeros((3,), jnp.int32)), ValueError, "`q_start_index` must be a scalar"),
    (dict(q_start_index=2**31), ValueError, "`q_start_index` must fit in int32"),
])
def test_bad_parameters(kw, exc, msg):
    with pytest.raises(exc, match="indexer_kl: " + msg):
        indexer_kl(**_good(), **kw)


def test_batched_shapes_must_agree():
    args = _good(batched=True)
    args["weights"] = jnp.zeros((3, 5, 4), F32)
    with pytest.raises(ValueError, match=r"indexer_kl: `weights` must have shape \[B, S, HI\] = \[2, 5, 4\]"):
        indexer_kl(**args)


def test_indexer_loss_bad_inputs_name_indexer_loss():
    p = synthetic.make_problem(S=4, N=8, H=4, T=3, D=16, seed=0)
    ix = synthetic.make_indexer(p, HI=2, DI=16)
    with pytest.raises(ValueError, match="indexer_loss: `index_k` must have shape"):
        indexer_loss(p.q, p.k, p.lse, ix.index_q, ix.index_k[:, :8], ix.weights, p.indices, lse_base="2", sm_scale=0.1)
    with pytest.raises(ValueError, match="indexer_loss: `scale` must be a finite positive"):
        indexer_loss(p.q, p.k, p.lse, *ix.arrays, p.indices, lse_base="2", sm_scale=0.1, scale=-1.0)
    with pytest.raises(ValueError, match="indexer_loss: `k` must have one kv head"):
        k2 = jnp.concatenate([p.k, p.k], axis=1)
        idx2 = jnp.concatenate([p.indices, p.indices], axis=1)
        indexer_loss(p.q, k2, p.lse, *ix.arrays, idx2, lse_base="2", sm_scale=0.1)


# ----------------------------------------------------------------------------
# the CUDA lowering (no GPU needed) and export
# ----------------------------------------------------------------------------


def _lower(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


_CALL = re.compile(rf"stablehlo\.custom_call @{indexer_contract.FWD_FFI_TARGET}\(")
_BWD_CALL = re.compile(rf"stablehlo\.custom_call @{indexer_contract.BWD_FFI_TARGET}\(")


@pytest.mark.parametrize("HI,DI,wdt", [(64, 128, F32), (1, 64, BF16), (200, 128, F32)])
def test_cuda_lowering_calls_the_kernel(cross_lowering, HI, DI, wdt):
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(0, B=2, S=4, HI=HI, DI=DI, N=9, T=5, weights_dtype=wdt,
                                                  q_start_index="batch")
    qs = kw.pop("q_start_index")
    f = lambda a, b, c, d, e, s: indexer_kl(a, b, c, d, e, q_start_index=s, **kw)  # noqa: E731
    text = _lower(f, (iq, ik, w, idx, tgt, qs), "cuda")
    assert len(_CALL.findall(text)) == 1
    assert re.search(r"scale = [-0-9.e+]+ : f32", text) and "k_stride = " in text
    # with gradients: one forward kernel call, and one backward kernel call
    # where it applies (HI <= 64), else the jnp backward
    g = _lower(jax.grad(lambda a: f(a, ik, w, idx, tgt, qs).sum()), (iq,), "cuda")
    assert len(_CALL.findall(g)) == 1
    assert len(_BWD_CALL.findall(g)) == (1 if HI <= indexer_contract.BWD_KERNEL_MAX_HEADS else 0)
    assert indexer_contract.FWD_FFI_TARGET not in _lower(f, (iq, ik, w, idx, tgt, qs), "cpu")


def test_cuda_lowering_of_the_backward(cross_lowering, fake_kernel_available):
    """The backward kernel's call in both modes: the deterministic attribute
    and its workspace (int64 sums [B, N, DI] + one word, as bytes; none in
    float32 mode), and the f32 d index_k cast to index_k's dtype."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(0, B=2, S=4, HI=16, DI=64, N=9, T=5, weights_dtype=BF16)
    problem = indexer_contract.check_problem(iq, ik, w, idx, tgt)
    assert indexer_contract.bwd_kernel_supports(problem) == (True, "supported")
    assert indexer_contract.bwd_kernel_supports(problem, deterministic=True) == (True, "supported")
    for deterministic, workspace in ((False, 0), (True, 8 * (2 * 9 * 64 + 1))):
        loss = lambda a, b, c: indexer_kl(a, b, c, idx, tgt, deterministic=deterministic, **kw).sum()  # noqa: E731
        text = _lower(jax.grad(loss, argnums=(0, 1, 2)), (iq, ik, w), "cuda")
        assert len(_BWD_CALL.findall(text)) == 1, deterministic
        assert len(_CALL.findall(text)) == 1
        call = text[text.index(f"@{indexer_contract.BWD_FFI_TARGET}("):]
        call = call[:call.index("\n")]
        assert f"deterministic = {str(deterministic).lower()}" in call, call
        assert f"tensor<{workspace}xui8>" in call, call
    # implementation="cuda" binds the forward; the backward still lowers (to its kernel here)
    loss = lambda a: indexer_kl(a, ik, w, idx, tgt, implementation="cuda", **kw).sum()  # noqa: E731
    assert len(_BWD_CALL.findall(_lower(jax.grad(loss), (iq,), "cuda"))) == 1


@pytest.mark.parametrize("change", [dict(dtype=F32), dict(DI=32), dict(HI=300)])
def test_cuda_lowering_uses_xla_where_the_kernel_does_not_apply(cross_lowering, change):
    shape = dict(HI=4, DI=64, dtype=BF16)
    shape.update(change)
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(0, S=3, N=9, T=5, **shape)
    problem = indexer_contract.check_problem(iq, ik, w, idx, tgt)
    assert not indexer_kernel_supports(problem)[0]
    assert indexer_contract.FWD_FFI_TARGET not in _lower(lambda *a: indexer_kl(*a, **kw), (iq, ik, w, idx, tgt), "cuda")
    with pytest.raises((ValueError, RuntimeError), match="implementation='cuda'"):
        _lower(lambda *a: indexer_kl(*a, implementation="cuda", **kw), (iq, ik, w, idx, tgt), "cuda")


def test_implementation_cuda_lowering_for_cpu_raises(monkeypatch):
    monkeypatch.setattr(ext, "_state", ext._State(True, "registered: (fake for tests)"))
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(0, S=3, HI=4, DI=64, N=9, T=5)
    with pytest.raises(ValueError, match="needs a CUDA device; lowering for cpu"):
        _lower(lambda *a: indexer_kl(*a, implementation="cuda", **kw), (iq, ik, w, idx, tgt), "cpu")


def test_export_for_cuda_and_cpu(cross_lowering):
    """One export with both platforms: the CUDA branch holds the kernel's
    custom call (named in disabled_checks), the CPU branch runs here."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-export"), S=6, HI=4, DI=64, N=9, T=5)
    f = jax.jit(lambda *a: indexer_kl(*a, **kw))
    exp = export.export(f, platforms=["cuda", "cpu"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(indexer_contract.FWD_FFI_TARGET)])(
        iq, ik, w, idx, tgt)
    assert indexer_contract.FWD_FFI_TARGET in exp.mlir_module()
    pytest.importorskip("flatbuffers", reason="Exported.serialize needs the flatbuffers package")
    back = export.deserialize(exp.serialize())
    np.testing.assert_allclose(back.call(iq, ik, w, idx, tgt), f(iq, ik, w, idx, tgt), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=indexer_contract.FWD_FFI_TARGET):
        export.export(f, platforms=["cuda"])(iq, ik, w, idx, tgt)
