"""SPEC §6 (packed sequences, per-row top-k lengths) on the CUDA kernels:
the §6 rule masks the indices in XLA and the SM90 kernels serve the rest
(implementation="cuda"), against the float64 oracle's independent reading of
§6. GPU only (see conftest.py); the jnp path's tests are test_packed.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from indexer_cases import BWD_TOLERANCE
from inputs import seed_of
from jax_attn_dist import _contract, attn_dist, indexer_kl, oracle
from test_packed import CASES, attn_problem, indexer_problem, no_owner_rows, oracle_kwargs, traced_call

pytestmark = pytest.mark.gpu

BF16 = jnp.bfloat16
# A kernel-sized packed case: 4 sequences of unequal length, an empty one,
# padding rows and keys, per-sequence starts, and rows with short top-k.
BIG = dict(name="big", S=512, N=560, T=192, cu_q=[0, 150, 150, 350, 500], cu_k=[0, 160, 160, 380, 540],
           q_start=[0, 7, 100, 33], topk=list(np.random.default_rng(0).integers(-5, 250, 512)))
GPU_CASES = [c for c in CASES if c["name"] in ("several", "k-stride-2", "topk-packed", "topk-alone",
                                               "rows-before-first", "bad-decreasing-q", "bad-k-past-N")] + [BIG]
IDS = [c["name"] for c in GPU_CASES]


@pytest.mark.parametrize("case", GPU_CASES, ids=IDS)
def test_attn_dist_kernel_on_packed_inputs(case):
    q, k, idx, lse, rule, pk = attn_problem(case, H=64, D=576, dtype=BF16)
    fn = functools.partial(attn_dist, implementation="cuda")
    text = jax.jit(lambda *a: fn(*a, **rule, **pk)).lower(q, k, idx, lse).as_text()
    assert _contract.FFI_TARGET in text
    got = np.asarray(traced_call(fn, (q, k, idx, lse), rule, pk))
    want = oracle.attn_dist_oracle(q, k, idx, lse, **rule, **oracle_kwargs(pk))
    if np.abs(want).max() == 0:
        assert np.all(got == 0)
    else:
        oracle.assert_within_spec(got, want)
    for s in no_owner_rows(case):
        assert np.all(got[:, s] == 0)


@pytest.mark.parametrize("case", GPU_CASES, ids=IDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_indexer_kernels_on_packed_inputs(case, deterministic):
    iq, ik, w, idx, tgt, rule, pk = indexer_problem(case, dtype=BF16, HI=64, DI=128)
    fn = functools.partial(indexer_kl, implementation="cuda", deterministic=deterministic)
    got = np.asarray(traced_call(fn, (iq, ik, w, idx, tgt), rule, pk))
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **rule, **oracle_kwargs(pk)))
    for s in no_owner_rows(case):
        assert got[s] == 0.0
    g = jnp.asarray(np.random.default_rng(seed_of("packed-gpu-grad", case["name"])).standard_normal(case["S"]),
                    jnp.float32)
    grad = jax.jit(jax.grad(lambda a, b, c: jnp.sum(g * fn(a, b, c, idx, tgt, **rule, **pk)), argnums=(0, 1, 2)))
    assert _contract.FFI_INDEXER_BWD in grad.lower(iq, ik, w).as_text()
    got_g = grad(iq, ik, w)
    # SPEC §3.2's bound for the backward kernel (bf16 dz): per element, 2^-7
    # of its terms' absolute sum, plus terms whose relu mask is ambiguous
    want, mags, ambiguous = oracle.indexer_grads_oracle(iq, ik, w, idx, tgt, g, **rule, magnitudes=True,
                                                        **oracle_kwargs(pk))
    for name, a, ref, mag, amb in zip(("d_index_q", "d_index_k", "d_weights"), got_g, want, mags, ambiguous):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        bound = BWD_TOLERANCE * mag + amb + 1e-6 * np.abs(ref).max()
        err = np.abs(a - ref)
        assert np.all(err <= bound), f"{name}: max excess {np.max(err - bound):.3e}"
    if deterministic:
        for a, b in zip(got_g, grad(iq, ik, w)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
