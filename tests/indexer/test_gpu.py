"""The SM90 indexer_kl forward and backward kernels on the GPU, against the
float64 oracle (SPEC §3.2), with poisoned outputs; the public API's kernel
path, its gradients, indexer_loss on both kernels, determinism and the FFI
handlers' own errors. GPU only (see conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grad_util import assert_grad_close
from indexer_cases import (Case, bwd_cotangent, check_bwd_case, check_case, check_sharded_steps, make_case_inputs,
                           run_bwd_kernel, run_kernel, sweep_cases)
from inputs import make_indexer_inputs, seed_of
from jax_attn_dist import indexer_kl, indexer_loss, oracle, synthetic
from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.indexer import contract as indexer_contract

pytestmark = pytest.mark.gpu

SWEEP = sweep_cases(40)
BWD_SWEEP = [c for c in SWEEP if c.HI <= indexer_contract.BWD_KERNEL_MAX_HEADS]


@pytest.mark.parametrize("case", SWEEP, ids=[c.name for c in SWEEP])
def test_sweep_matches_float64(case):
    check_case(case)


@pytest.mark.parametrize("HI", [16, 32, 64, 128])
@pytest.mark.parametrize("DI", [64, 128])
def test_full_topk(HI, DI):
    check_case(Case(S=12, HI=HI, DI=DI, T=2048, N=8192, invalid_fraction=0.05, seed=HI + DI))


@pytest.mark.parametrize("case", BWD_SWEEP, ids=[c.name for c in BWD_SWEEP])
def test_bwd_sweep_matches_float64(case):
    check_bwd_case(case)


@pytest.mark.parametrize("case", BWD_SWEEP, ids=lambda c: c.name)
def test_bwd_deterministic_sweep_matches_float64_and_float32_mode(case):
    """The fixed-point d index_k: within the same bound of float64, and
    d index_q / d weights bit-identical to the float32-atomic mode's (the
    modes differ only in how d index_k's terms are summed)."""
    dq, dw, dk = check_bwd_case(case, deterministic=True)
    inputs, kwargs = make_case_inputs(case)
    _, lse = run_kernel(inputs, kwargs)
    dq32, dw32, dk32 = run_bwd_kernel(inputs, kwargs, lse, bwd_cotangent(case))
    assert dq.tobytes() == dq32.tobytes() and dw.tobytes() == dw32.tobytes()
    top = np.abs(dk32).max() if dk32.size else 0.0
    np.testing.assert_allclose(dk, dk32, rtol=1e-4, atol=1e-6 * top)


@pytest.mark.parametrize("HI", [16, 32, 64])
@pytest.mark.parametrize("DI", [64, 128])
def test_bwd_full_topk(HI, DI):
    check_bwd_case(Case(S=12, HI=HI, DI=DI, T=2048, N=8192, invalid_fraction=0.05, seed=HI + DI + 1))


def test_bwd_duplicates_and_hot_keys():
    """Every slot of every row on a few keys: duplicates within a block and
    across rows all accumulate (the atomics' worst case)."""
    case = Case(S=64, HI=64, T=512, N=4, causal=False, invalid_fraction=0.0, seed=21)
    check_bwd_case(case)


def test_bwd_large_logits_zero_targets_and_invalid_rows():
    check_bwd_case(Case(S=16, HI=64, T=512, N=2000, scale=40.0, seed=5))
    check_bwd_case(Case(S=16, HI=64, T=300, N=2000, zero_rows=0.5, seed=6))
    inputs, kwargs = make_case_inputs(Case(S=8, HI=64, T=256, N=2000, invalid_fraction=1.0, seed=7))
    _, lse = run_kernel(inputs, kwargs)
    dq, dw, dk = run_bwd_kernel(inputs, kwargs, lse, np.ones(lse.shape, np.float32))
    assert np.all(dq == 0) and np.all(dw == 0) and np.all(dk == 0)


@pytest.mark.parametrize("HI,DI", [(64, 128), (16, 64)])
def test_bwd_deterministic_mode_is_bitwise_at_idx_v32(HI, DI):
    """deterministic=True: every gradient has the same bits over 5 runs, at
    SPEC §7's idx-v32 shape (S = 4096, N = 8192, T = 2048) where keys are hit
    by hundreds of rows, and its d index_k matches the float32 mode's there."""
    case = Case(S=4096, HI=HI, DI=DI, T=2048, N=8192, invalid_fraction=0.02, seed=13 + HI)
    inputs, kwargs = make_case_inputs(case)
    _, lse = run_kernel(inputs, kwargs)
    g = bwd_cotangent(case)
    first = run_bwd_kernel(inputs, kwargs, lse, g, deterministic=True)
    for _ in range(4):
        again = run_bwd_kernel(inputs, kwargs, lse, g, deterministic=True)
        for name, a, b in zip(("d_index_q", "d_weights", "d_index_k"), first, again):
            assert a.tobytes() == b.tobytes(), name
    _, _, dk32 = run_bwd_kernel(inputs, kwargs, lse, g)
    np.testing.assert_allclose(first[2], dk32, rtol=1e-4, atol=1e-6 * np.abs(dk32).max())


def test_bwd_deterministic_mode_flags_non_finite_terms():
    """Keys so large that exp(logit - lse) overflows make the valid slots' dl
    infinite (lse is the residual of the finite inputs). The fixed-point sums
    cannot hold that, and the row bound does not see index_k, so the main
    kernel flags it: d index_k is NaN everywhere rather than silently missing
    those terms. (An infinite index_k is no test of this: z is then NaN, which
    relu maps to 0 in both modes, and the terms are 0.)"""
    case = Case(S=16, HI=64, T=256, N=500, seed=17)
    inputs, kwargs = make_case_inputs(case)
    _, lse = run_kernel(inputs, kwargs)
    bad = list(inputs)
    bad[1] = jnp.asarray(np.asarray(inputs[1], np.float32) * 1e30, jnp.bfloat16)
    _, _, dk = run_bwd_kernel(bad, kwargs, lse, np.ones(lse.shape, np.float32), deterministic=True)
    assert np.isnan(dk).all()


def test_bwd_d_index_q_and_d_weights_are_bitwise_deterministic():
    case = Case(S=256, HI=64, T=2048, N=8192, B=2, per_batch_q_start=True, seed=12)
    inputs, kwargs = make_case_inputs(case)
    _, lse = run_kernel(inputs, kwargs)
    g = bwd_cotangent(case)
    first = run_bwd_kernel(inputs, kwargs, lse, g)
    for _ in range(3):
        again = run_bwd_kernel(inputs, kwargs, lse, g)
        assert again[0].tobytes() == first[0].tobytes() and again[1].tobytes() == first[1].tobytes()
        np.testing.assert_allclose(again[2], first[2], rtol=1e-4, atol=1e-6 * np.abs(first[2]).max())


def test_large_logits_and_all_zero_targets():
    check_case(Case(S=16, HI=64, T=512, N=2000, scale=40.0, seed=5))
    check_case(Case(S=16, HI=64, T=300, N=2000, zero_rows=1.0, seed=6))
    check_case(Case(S=8, HI=64, T=256, N=2000, invalid_fraction=1.0, seed=7))


def test_bitwise_deterministic():
    inputs, kwargs = make_case_inputs(Case(S=256, HI=64, T=2048, N=8192, B=2, per_batch_q_start=True, seed=11))
    first = run_kernel(inputs, kwargs)
    for _ in range(4):
        again = run_kernel(inputs, kwargs)
        for a, b in zip(first, again):
            assert a.tobytes() == b.tobytes()


def test_public_api_uses_the_kernel_with_traced_q_start():
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-gpu-api"), B=2, S=40, HI=64, DI=128, N=700,
                                                  T=300, q_start_index="batch", weights_dtype=jnp.bfloat16)
    qs = kw.pop("q_start_index")
    f = jax.jit(lambda a, b, c, d, e, s: indexer_kl(a, b, c, d, e, q_start_index=s, implementation="cuda", **kw))
    assert indexer_contract.FWD_FFI_TARGET in f.lower(iq, ik, w, idx, tgt, qs).as_text()
    got = f(iq, ik, w, idx, tgt, qs)
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, q_start_index=qs, **kw))
    default = jax.jit(lambda *a: indexer_kl(*a, q_start_index=qs, **kw))
    assert indexer_contract.FWD_FFI_TARGET in default.lower(iq, ik, w, idx, tgt).as_text()  # the default on a GPU
    # unbatched
    got0 = jax.jit(lambda *a: indexer_kl(*a, q_start_index=qs[0], implementation="cuda", **kw))(
        iq[0], ik[0], w[0], idx[0], tgt[0])
    oracle.assert_indexer_close(got0, oracle.indexer_kl_oracle(iq[0], ik[0], w[0], idx[0], tgt[0],
                                                               q_start_index=int(qs[0]), **kw))


@pytest.mark.parametrize("deterministic", [False, True])
def test_kernel_path_gradients(deterministic):
    """Forward on the kernel; backward on its kernel in either mode: the
    gradients match the float64 formulas and the XLA path's, and the
    deterministic mode's bits repeat."""
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("indexer-gpu-grad", deterministic), B=2, S=24, HI=64,
                                                  DI=128, N=300, T=200, q_start_index="batch")
    rng = np.random.default_rng(3)
    g = jnp.asarray(rng.standard_normal((2, 24)), jnp.float32)
    qs = kw.pop("q_start_index")

    def grads(impl):
        loss = lambda a, b, c: jnp.sum(g * indexer_kl(a, b, c, idx, tgt, q_start_index=qs, implementation=impl,  # noqa: E731
                                                      deterministic=deterministic, **kw))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(iq, ik, w)

    text = jax.jit(jax.grad(lambda a: jnp.sum(indexer_kl(a, ik, w, idx, tgt, q_start_index=qs, implementation="cuda",
                                                          deterministic=deterministic, **kw)))).lower(iq).as_text()
    assert indexer_contract.BWD_FFI_TARGET in text  # both modes have a kernel
    got, xla = grads("cuda"), grads("xla")
    want = oracle.indexer_grads_oracle(iq, ik, w, idx, tgt, g, q_start_index=qs, **kw)
    for name, a, b, o in zip(("d_index_q", "d_index_k", "d_weights"), got, xla, want):
        assert_grad_close(a, o, name + " vs float64", 1e-2, 1e-3)
        assert_grad_close(a, b, name + " vs XLA path", 1e-2, 1e-3)
    if deterministic:
        again = grads("cuda")
        for a, b in zip(got, again):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_indexer_loss_on_both_kernels():
    p = synthetic.make_problem(S=128, N=1024, H=128, T=256, D=576, B=2, lse_base="e", seed=9)
    ix = synthetic.make_indexer(p, HI=64, DI=128, seed=9)
    f = jax.jit(lambda *a: indexer_loss(*a, implementation="cuda", **p.kwargs))
    args = (p.q, p.k, p.lse, *ix.arrays, p.indices)
    text = f.lower(*args).as_text()
    assert attn_contract.FFI_TARGET in text and indexer_contract.FWD_FFI_TARGET in text
    got = f(*args)
    mass = oracle.attn_dist_oracle(*p.arrays, **p.kwargs).sum(axis=1)
    total = mass.sum(-1, keepdims=True)
    target = np.where(total > 0, mass / np.where(total > 0, total, 1), 0)
    want = oracle.indexer_kl_oracle(*ix.arrays, p.indices, target, causal=p.causal, q_start_index=p.q_start_index,
                                    k_stride=p.k_stride)
    oracle.assert_indexer_close(got, want)


def test_zero_topk_writes_zero_kl_and_minus_inf_lse():
    """T = 0 through the handler directly (the public API returns zeros
    without a launch): every row still written."""
    inputs, kwargs = make_case_inputs(Case(S=5, HI=16, T=0, N=10, seed=1))
    kl, lse = run_kernel(inputs, kwargs)
    assert np.all(kl == 0) and np.all(lse == -np.inf)


def _raw_ffi(**change):
    shapes = dict(index_q=(1, 4, 64, 128), index_k=(1, 32, 128), weights=(1, 4, 64), indices=(1, 4, 1, 64),
                  target=(1, 4, 64), q_start=(1,), row_ranges=(1, 4, 0), out=(1, 4))
    attrs = dict(scale=1.0, k_stride=1)
    for k, v in change.items():
        (shapes if k in shapes else attrs)[k] = v
    dt = dict(index_q=jnp.bfloat16, index_k=jnp.bfloat16, weights=jnp.float32, indices=jnp.int32,
              target=jnp.float32, q_start=jnp.int32, row_ranges=jnp.int32)
    args = [jnp.zeros(shapes[n], dt[n]) for n in dt]
    out = jax.ShapeDtypeStruct(shapes["out"], jnp.float32)
    call = jax.ffi.ffi_call(indexer_contract.FWD_FFI_TARGET, (out, out))
    return jax.block_until_ready(jax.jit(lambda *a: call(*a, scale=np.float32(attrs["scale"]), causal=True,
                                                         k_stride=np.int32(attrs["k_stride"])))(*args))


BAD = {
    "DI=32": (dict(index_q=(1, 4, 64, 32), index_k=(1, 32, 32)), "DI must be 64 or 128"),
    "HI=300": (dict(index_q=(1, 4, 300, 128), weights=(1, 4, 300)), "HI must be in"),
    "index_q rank": (dict(index_q=(4, 64, 128)), "index_q must be rank 4"),
    "index_k DI": (dict(index_k=(1, 32, 64)), "index_k must have shape"),
    "weights": (dict(weights=(1, 4, 63)), "weights must have shape"),
    "indices HK": (dict(indices=(1, 4, 2, 64)), "indices must have shape"),
    "target T": (dict(target=(1, 4, 65)), "target must have shape"),
    "q_start": (dict(q_start=(2,)), "q_start must have shape"),
    "row_ranges": (dict(row_ranges=(1, 4, 4)), "row_ranges must have shape"),
    "out": (dict(out=(1, 5)), "kl must have shape"),
    "scale": (dict(scale=float("nan")), "scale must be finite"),
    "k_stride": (dict(k_stride=0), "k_stride must be >= 1"),
}


def test_ffi_handler_accepts_good_call():
    kl, lse = _raw_ffi()
    assert kl.shape == (1, 4) and np.all(np.asarray(kl) == 0)


@pytest.mark.parametrize("name", list(BAD))
def test_ffi_handler_returns_clear_errors(name):
    change, message = BAD[name]
    with pytest.raises(Exception, match=message):
        _raw_ffi(**change)


def _raw_bwd_ffi(HI=64, g_rows=4, deterministic=False, workspace=None):
    dt = dict(index_q=((1, 4, HI, 128), jnp.bfloat16), index_k=((1, 32, 128), jnp.bfloat16),
              weights=((1, 4, HI), jnp.float32), indices=((1, 4, 1, 64), jnp.int32),
              target=((1, 4, 64), jnp.float32), q_start=((1,), jnp.int32), lse=((1, 4), jnp.float32),
              g=((1, g_rows), jnp.float32))  # no row_ranges: the optional operand left out
    args = [jnp.zeros(shape, d) for shape, d in dt.values()]
    if workspace is None:
        workspace = 8 * (32 * 128 + 1) if deterministic else 0
    outs = (jax.ShapeDtypeStruct((1, 4, HI, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 4, HI), jnp.float32),
            jax.ShapeDtypeStruct((1, 32, 128), jnp.float32), jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    call = jax.ffi.ffi_call(indexer_contract.BWD_FFI_TARGET, outs)
    return jax.block_until_ready(jax.jit(lambda *a: call(*a, scale=np.float32(1.0), causal=True,
                                                         k_stride=np.int32(1), deterministic=deterministic))(*args))[:3]


@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_ffi_handler_accepts_good_call_and_returns_clear_errors(deterministic):
    dq, dw, dk = _raw_bwd_ffi(deterministic=deterministic)
    assert not np.asarray(dq.astype(jnp.float32)).any() and not np.asarray(dk).any()
    with pytest.raises(Exception, match=r"HI must be in \[1, 64\]"):
        _raw_bwd_ffi(HI=100, deterministic=deterministic)
    with pytest.raises(Exception, match="g must have shape"):
        _raw_bwd_ffi(g_rows=5, deterministic=deterministic)
    with pytest.raises(Exception, match="workspace must be uint8"):
        _raw_bwd_ffi(deterministic=deterministic, workspace=8 if deterministic else 16)


def test_bwd_deterministic_steps_for_sharded_rows_give_the_one_calls_bits():
    """The steps an S-sharded deterministic backward takes per shard, run on
    one GPU with no shard to reduce over, give the one call's bits
    (indexer_cases.check_sharded_steps)."""
    check_sharded_steps(seed_of("indexer-gpu-det-steps"))
