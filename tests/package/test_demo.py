"""The synthetic problem generator and ``python -m jax_attn_dist``."""

from __future__ import annotations

import numpy as np
import pytest

from jax_attn_dist import oracle
from jax_attn_dist import __main__ as demo
from jax_attn_dist import synthetic


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("k_stride", [1, 4])
def test_make_problem_indices(causal, k_stride):
    S, N, T, HK = 10, 12, 6, 2
    p = synthetic.make_problem(S=S, N=N, H=4, T=T, D=16, B=2, HK=HK, causal=causal, k_stride=k_stride,
                               q_start_index=[0, 30], seed=3)
    idx = np.asarray(p.indices)
    assert idx.shape == (2, S, HK, T) and idx.dtype == np.int32
    visible = oracle.valid_mask(np.broadcast_to(np.arange(N), (2, S, HK, N)), N, causal=causal,
                                q_start_index=np.array([0, 30]), k_stride=k_stride)
    for b in range(2):
        for s in range(S):
            for kh in range(HK):
                row = idx[b, s, kh]
                picked = row[row >= 0]
                n_vis = int(visible[b, s, kh].sum())
                assert len(picked) == min(T, n_vis)
                assert len(set(picked.tolist())) == len(picked)  # distinct
                assert np.all(visible[b, s, kh][picked])  # visible under the causal rule
                assert np.all(row[len(picked):] == -1)  # padding at the end
    # lse is the exact LSE of those slots: every head sums to 1
    want_lse = oracle.exact_lse(*p.arrays[:3], **{k: v for k, v in p.kwargs.items()})
    np.testing.assert_allclose(np.asarray(p.lse), want_lse, rtol=1e-5, atol=1e-5)


def test_make_problem_is_seeded():
    a = synthetic.make_problem(S=4, N=8, H=2, T=3, D=8, seed=7)
    b = synthetic.make_problem(S=4, N=8, H=2, T=3, D=8, seed=7)
    c = synthetic.make_problem(S=4, N=8, H=2, T=3, D=8, seed=8)
    for x, y in zip(a.arrays, b.arrays):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a.q), np.asarray(c.q))
    assert a.flops == 2 * 4 * 2 * 3 * 8


def test_demo_runs(capsys):
    rc = demo.main(["-S", "16", "-N", "40", "--heads", "80", "--topk", "8", "--dim", "32", "--batch", "2",
                    "--idx-heads", "8", "--idx-dim", "16", "--lse-base", "e", "--k-stride", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for word in ("jax", "ran on:", "kernels:", "path:", "jnp (XLA)", "time:", "vs float64", "invariant", "loss:",
                 "PASS"):
        assert word in out
    if "the jnp paths (XLA)" in out:  # a rate is printed only for the kernels
        assert "TFLOP/s" not in out


@pytest.mark.parametrize("broken", ["attn_dist_oracle", "indexer_kl_oracle"])
def test_demo_fails_when_a_result_is_wrong(capsys, monkeypatch, broken):
    """The demo's PASS means something: a float64 reference that disagrees
    (here: one made 1% off) turns it into FAIL and a non-zero exit."""
    real = getattr(oracle, broken)
    monkeypatch.setattr(oracle, broken, lambda *a, **k: real(*a, **k) * 1.01 + 0.01)
    rc = demo.main(["-S", "12", "-N", "30", "--heads", "4", "--topk", "6", "--dim", "16", "--idx-heads", "4",
                    "--idx-dim", "16", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "PASS" not in out, out


def test_demo_checks_slabs_of_long_problems():
    assert demo._slabs(100) == [(0, 100)]
    assert demo._slabs(1024) == [(0, demo.ORACLE_SLAB), (1024 - demo.ORACLE_SLAB, 1024)]


def test_demo_help(capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--seq", "--keys", "--heads", "--topk", "--dim", "--idx-heads", "--idx-dim", "--batch", "--lse-base",
                "--implementation", "--seed", "--repeats"):
        assert opt in out


def test_demo_cuda_without_kernel_fails_cleanly(capsys, monkeypatch):
    from jax_attn_dist._core import ext

    monkeypatch.setattr(ext, "_state", ext._State(False, "not built (test)"))
    rc = demo.main(["-S", "4", "-N", "8", "--heads", "2", "--topk", "2", "--dim", "576", "--implementation", "cuda"])
    assert rc != 0
    assert "not available" in capsys.readouterr().err
