"""The benchmark's own pieces that run anywhere: the plain-XLA versions it
compares against (benchmarks/plain_xla.py: the indexer loss, sparse MLA and
its gradients, the layer's target, the whole layer) compute the SPEC, the
plot is drawn from a results file, the sparse_mla and indexer_topk rows are registered, count SPEC §8's
and §9's FLOPs and build their rows (on tiny shapes, the jnp path standing
in for the kernel). (The timings themselves need a GPU: benchmarks/bench.py.)"""

from __future__ import annotations

import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from inputs import make_indexer_inputs, seed_of
from jax_attn_dist import oracle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench", os.path.join(ROOT, "benchmarks", "bench.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_plain_xla_indexer_loss_is_the_spec():
    iq, ik, w, idx, tgt, kw = make_indexer_inputs(seed_of("bench-xla"), S=9, HI=8, DI=16, N=20, T=12)
    got = bench.xla_indexer_kl(iq, ik, w, idx, tgt, **kw)
    oracle.assert_indexer_close(got, oracle.indexer_kl_oracle(iq, ik, w, idx, tgt, **kw))


def test_plot_from_results(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(name="v32-h128", kind="attn_dist", kernel_ms=2.1, kernel_tflops=580.0, xla_tflops=90.0),
            dict(name="idx-v32", kind="indexer", kernel_ms=0.35, kernel_tflops=390.0, xla_tflops=40.0),
            dict(name="mla-v32-h128", kind="sparse_mla", kernel_ms=3.0, kernel_tflops=600.0, xla_tflops=80.0),
            dict(name="topk-128k", kind="indexer_topk", kernel_ms=4.0, kernel_tflops=500.0),
            dict(name="step-v32", kind="step", kernel_ms=4.0)]
    result = dict(rows=rows, gemm_8192_tflops=740.0, commit="abc", device="H100", jax="0.11.2")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert bench.main(["--plot", str(path)]) == 0
    png = tmp_path / "r.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_lists_every_row():
    rows = [dict(name="idx-v32", kind="indexer", kernel_ms=0.35, kernel_tflops=390.0, kernel_frac_gemm=0.5,
                 xla_ms=3.6, speedup_vs_xla=10.3, kernel_fwd_bwd_ms=5.0, xla_fwd_bwd_ms=23.7),
            dict(name="step-v32", kind="step", kernel_ms=4.0, xla_ms=25.7, speedup_vs_xla=6.4)]
    text = bench.table(dict(rows=rows))
    assert "idx-v32" in text and "step-v32" in text and "23.70" in text
    assert "nan" not in text  # columns that do not apply to a row are blank


def test_packed_layout_keeps_every_slot_valid():
    """The packed benchmark's layout: every slot valid under SPEC §6 (so the
    packed and the unpacked calls do the same work), rows in 4 sequences."""
    import jax.numpy as jnp

    idx, cu_q, cu_k, qs = bench.packed_layout(64, 96, 40, num_seqs=4, seed=0)
    assert idx.shape == (64, 1, 40) and idx.dtype == jnp.int32
    valid = oracle.valid_mask(np.asarray(idx)[None], 96, causal=True, q_start_index=np.asarray(qs), k_stride=1,
                              cu_seqlens_q=np.asarray(cu_q), cu_seqlens_k=np.asarray(cu_k))
    assert valid.all()
    assert list(np.asarray(cu_q)) == [0, 16, 32, 48, 64] and list(np.asarray(cu_k)) == [0, 24, 48, 72, 96]



def test_sparse_mla_and_topk_rows_are_registered():
    names = list(bench.SPARSE_MLA_SHAPES) + list(bench.TOPK_SHAPES)
    assert names == ["mla-v32-h128", "mla-v32-h64", "mla-128k-h128", "topk-v32", "topk-v32-fp8", "topk-32k",
                     "topk-128k"]
    assert set(names) <= set(bench.ALL) and len(set(bench.ALL)) == len(bench.ALL)
    assert bench.SPARSE_MLA_SHAPES["mla-v32-h128"] == (4096, 8192, 128, 2048, 576, 512)
    assert bench.SPARSE_MLA_SHAPES["mla-128k-h128"][1] == 131072
    assert [bench.TOPK_SHAPES[n][1] for n in bench.TOPK_SHAPES] == [8192, 8192, 32768, 131072]
    import jax

    if jax.default_backend() != "gpu":  # the names parse; without a GPU main stops before timing
        assert bench.main(["--shapes", *names]) == 2


def test_flop_counts():
    """SPEC §8.2's 2 S H T (D + d_v); the causal logits GEMM of §9 counts
    each visible (row, key) pair, S (N - S/2) + S/2 of them at q_start = N - S,
    and as many as the float64 oracle has finite logits."""
    assert bench.sparse_mla_flops(4096, 128, 2048, 576, 512) == 2 * 4096 * 128 * 2048 * (576 + 512)
    S, N = 4096, 8192
    assert bench.logits_flops(S, N, 64, 128, N - S) == 2 * 64 * 128 * (S * (N - S // 2) + S // 2)
    from indexer_topk_bench import visible_keys

    rng = np.random.default_rng(0)
    for q_start, k_stride in ((5, 1), (-3, 1), (7, 3), (40, 2)):
        iq, ik, w = rng.random((9, 1, 2)), rng.random((20, 2)), rng.random((9, 1))
        logits = oracle.indexer_topk_logits_oracle(iq, ik, w, q_start_index=q_start, k_stride=k_stride)
        assert visible_keys(9, 20, q_start, k_stride) == int(np.isfinite(logits).sum())


@pytest.mark.parametrize("lse_base,k_stride,remat", [("2", 1, True), ("e", 3, True), ("e", 1, False)])
def test_plain_xla_sparse_mla_is_the_spec(lse_base, k_stride, remat):
    """The plain-XLA baseline the sparse_mla rows compare against computes
    SPEC §8 (against the float64 oracle, to bf16's rounding of P and out),
    its gradient too (XLA's autodiff), on adversarial indices (out of range,
    duplicates, rows with no valid slot), with a key stride, across several
    chunks with padding rows."""
    import jax

    from plain_xla import xla_sparse_mla
    from sparse_mla_cases import make_sparse_mla_inputs

    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("bench-plain-mla", lse_base), S=11, H=4, D=64, N=40, T=24,
                                            d_v=32, lse_base=lse_base, k_stride=k_stride, empty_rows=0.2)
    rule = dict(sm_scale=kw["sm_scale"], d_v=32, causal=True, q_start_index=kw["q_start_index"], k_stride=k_stride,
                lse_base=lse_base)
    f = lambda q, kv: xla_sparse_mla(q, kv, idx, **rule, chunk=4, remat=remat)  # noqa: E731
    (out, lse), vjp = jax.vjp(f, q, kv)
    ref_out, ref_lse = oracle.sparse_mla_oracle(q, kv, idx, **rule)
    assert np.isneginf(ref_lse).any() and np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
    rel, _ = oracle.spec_errors(jnp.asarray(out, jnp.float32), ref_out)
    assert rel < 5e-3  # about 2.2e-3 (bf16 P and out)
    finite = np.isfinite(ref_lse)
    assert np.abs(np.asarray(lse)[finite] - ref_lse[finite]).max() < 1e-5
    rng = np.random.default_rng(0)
    dout = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32), jnp.bfloat16)
    dlse = jnp.asarray(rng.standard_normal(lse.shape).astype(np.float32))  # rows with no valid slot too
    dq, dkv = vjp((dout, dlse))
    ref_dq, ref_dkv = oracle.sparse_mla_grads_oracle(q, kv, idx, np.asarray(dout, np.float64),
                                                     np.asarray(dlse, np.float64), **rule)
    for got, ref in ((dq, ref_dq), (dkv, ref_dkv)):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert oracle.spec_errors(jnp.asarray(got, jnp.float32), ref)[0] < 5e-3  # about 2.3e-3 and 2.9e-3


def test_plain_xla_attn_target_is_the_spec():
    """The plain-XLA layer's target: attn_dist's float64 mass summed over
    heads and L1-normalised, on adversarial indices, lse = +-inf heads and
    rows with no valid slot (target 0), across chunks with padding rows."""
    from plain_xla import xla_attn_target
    from sparse_mla_cases import make_sparse_mla_inputs

    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("bench-plain-target"), S=11, H=4, D=64, N=40, T=24,
                                            lse_base="e", empty_rows=0.2)
    rule = dict(sm_scale=kw["sm_scale"], causal=True, q_start_index=kw["q_start_index"], k_stride=1)
    lse = np.asarray(oracle.sparse_mla_oracle(q, kv, idx, **rule, d_v=64, lse_base="e")[1], np.float32)
    lse[0, 1], lse[3, 2] = np.inf, -np.inf
    got = np.asarray(xla_attn_target(q, kv, idx, jnp.asarray(lse), **rule, chunk=4))
    mass = oracle.attn_dist_oracle(q, kv, idx, lse, **rule, lse_base="e").sum(axis=0)  # [S, T]
    total = mass.sum(-1, keepdims=True)
    ref = np.where(total > 0, mass / np.where(total > 0, total, 1.0), 0.0)
    assert (total == 0).any() and np.abs(got - ref).max() < 1e-5


def test_sparse_mla_row_on_cpu():
    row = bench.bench_sparse_mla("mla-v32-h64", (8, 40, 4, 16, 64, 32), calls=1, samples=1, gemm_tflops=1.0,
                                 implementation="xla")
    assert row["kind"] == "sparse_mla" and row["flops"] == 2 * 8 * 4 * 16 * (64 + 32)
    assert row["kernel_ms"] > 0 and row["xla_ms"] > 0 and row["jnp_ms"] > 0 and row["gemm_floor_ms"] > 0
    assert row["lse_err_vs_exact"] < 1e-4  # the synthetic problem's exact lse is the op's
    assert row["rel_err_vs_jnp"] == 0.0 and row["lse_err_vs_jnp"] == 0.0  # the jnp path is the timed one here
    assert row["rel_err_vs_xla"] < 1e-2 and row["xla_lse_err_vs_exact"] < 1e-4  # the plain XLA: bf16 P
    from sparse_mla_bench import SPARSE_MLA_XLA_SHAPES

    assert SPARSE_MLA_XLA_SHAPES == ("mla-v32-h128", "mla-v32-h64")


def test_backward_timing_keeps_the_forward():
    """The backward rows time forward + backward minus the forward: the
    timed forward + backward must return the forward's outputs (the same
    bits as the forward alone), or XLA drops a rematerialised forward from
    it and the difference is the backward less a forward."""
    import jax

    from plain_xla import xla_sparse_mla
    from sparse_mla_bench import forward_and_backward
    from sparse_mla_cases import make_sparse_mla_inputs

    q, kv, idx, kw = make_sparse_mla_inputs(seed_of("bench-bwd-timing"), S=8, H=4, D=64, N=40, T=16, d_v=32)
    rule = dict(sm_scale=kw["sm_scale"], d_v=32, causal=True, q_start_index=kw["q_start_index"], k_stride=1,
                lse_base="2")
    forward = lambda q, kv, i: xla_sparse_mla(q, kv, i, **rule, chunk=4)  # noqa: E731
    dout, dlse = jnp.ones((8, 4, 32), jnp.bfloat16), jnp.ones((8, 4), jnp.float32)
    (out, lse), (dq, dkv) = forward_and_backward(forward)(q, kv, idx, dout, dlse)
    ref_out, ref_lse = jax.jit(forward)(q, kv, idx)
    assert np.array_equal(np.asarray(out), np.asarray(ref_out)) and np.array_equal(np.asarray(lse), np.asarray(ref_lse))
    assert dq.shape == q.shape and dkv.shape == kv.shape


def test_sparse_mla_bwd_row_on_cpu():
    """The backward row's code on the jnp path: both modes run, the FLOPs are
    the five GEMMs', and the XLA row agrees with the timed path."""
    assert list(bench.SPARSE_MLA_BWD_SHAPES) == ["mla-bwd-v32-h128", "mla-bwd-v32-h64", "mla-bwd-det-v32-h128",
                                                 "mla-bwd-det-v32-h64"]
    assert set(bench.SPARSE_MLA_BWD_SHAPES) <= set(bench.ALL)
    assert bench.sparse_mla_bwd_flops(4096, 128, 2048, 576, 512) == 2 * 4096 * 128 * 2048 * (3 * 576 + 2 * 512)
    for det in (False, True):
        row = bench.bench_sparse_mla_bwd("mla-bwd-v32-h128", ((8, 40, 4, 16, 64, 32), det), calls=1, samples=1,
                                         gemm_tflops=1.0, implementation="xla")
        assert row["kind"] == "sparse_mla_bwd" and row["deterministic"] == det
        assert row["kernel_fwd_bwd_ms"] > 0 and row["xla_fwd_bwd_ms"] > 0 and row["jnp_fwd_bwd_ms"] > 0
        assert row["dq_rel_err_vs_jnp"] < 1e-6 and row["dkv_rel_err_vs_jnp"] < 1e-6
        for key in ("xla", "xla_saved"):
            assert row[f"{key}_fwd_bwd_ms"] > 0
            assert row[f"dq_rel_err_vs_{key}"] < 1e-2 and row[f"dkv_rel_err_vs_{key}"] < 1e-2


def test_indexer_topk_row_on_cpu():
    row = bench.bench_indexer_topk("topk-v32", (10, 40, 4, 16, 8), calls=1, samples=1, gemm_tflops=1.0,
                                   implementation="xla")
    assert row["kind"] == "indexer_topk" and row["flops"] == bench.logits_flops(10, 40, 4, 16, 30)
    assert row["kernel_ms"] > 0 and row["xla_ms"] > 0
    assert row["oracle_rows_checked"] == 8 and row["oracle_rows_bad"] == 0
    assert row["rows_differing_from_xla"] == 0
    assert row["kernel_frac_gemm"] == pytest.approx(row["gemm_floor_ms"] / row["kernel_ms"])
    from indexer_topk_bench import TOPK_XLA_SHAPES

    assert TOPK_XLA_SHAPES == ("topk-v32", "topk-v32-fp8")


def test_indexer_topk_fp8_row_on_cpu():
    """The float8 row quantises the inputs (key scales as index_k_scale) and
    checks its rows against the float64 logits of the float8 values."""
    row = bench.bench_indexer_topk("topk-v32-fp8", (10, 40, 4, 16, 8, "fp8"), calls=1, samples=1, gemm_tflops=1.0,
                                   implementation="xla")
    assert row["dtype"] == "float8_e4m3fn" and row["fp8_gemm_tflops"] == 1.0
    assert row["oracle_rows_checked"] == 8 and row["oracle_rows_bad"] == 0
    assert row["rows_differing_from_xla"] == 0
    from indexer_topk_bench import topk_problem

    (iq, ik, w), kw = topk_problem(10, 40, 4, 16, 0, fp8=True)
    assert iq.dtype == ik.dtype == jnp.float8_e4m3fn and kw["index_k_scale"].shape == (40,)


def test_table_has_the_floor_column():
    rows = [dict(name="topk-v32", kind="indexer_topk", kernel_ms=0.5, kernel_tflops=300.0, kernel_frac_gemm=0.4,
                 gemm_floor_ms=0.2, xla_ms=9.0, speedup_vs_xla=18.0),
            dict(name="mla-128k-h128", kind="sparse_mla", kernel_ms=4.0, kernel_tflops=560.0, gemm_floor_ms=3.0)]
    text = bench.table(dict(rows=rows))
    assert "floor ms" in text and "0.200" in text and "3.000" in text and "mla-128k-h128" in text


def test_dsa_layer_row_on_cpu():
    """The layer row's code on the jnp path (standing in for the kernels):
    the layer, its XLA twin and the four parts are timed, the two losses and
    selections agree, and the row is registered at V3.2's shapes."""
    assert bench.DSA_SHAPES["dsa-layer-v32"] == (4096, 8192, 128, 576, 512, 2048, 64, 128)
    assert "dsa-layer-v32" in bench.ALL
    row = bench.bench_dsa_layer("dsa-layer-v32", (16, 40, 4, 32, 16, 8, 4, 16), calls=1, samples=1,
                                gemm_tflops=1.0, implementation="xla")
    assert row["kind"] == "dsa_layer" and row["kernel_ms"] > 0 and row["xla_ms"] > 0 and row["jnp_ms"] > 0
    from dsa_bench import PARTS

    for key in ("parts_ms", "xla_parts_ms", "xla_saved_parts_ms", "jnp_parts_ms"):
        assert list(row[key]) == list(PARTS) and all(v > 0 for v in row[key].values())
    assert row["loss"] == pytest.approx(row["loss_jnp"], rel=1e-6) and row["rows_differing_from_jnp"] == 0
    assert row["loss"] == pytest.approx(row["loss_xla"], rel=1e-2) and row["rows_differing_from_xla"] == 0
    assert row["loss_xla_saved"] == pytest.approx(row["loss_xla"], rel=1e-6)
    assert "dsa-layer-v32" in bench.table(dict(rows=[row]))


def test_plain_xla_layer_is_the_layer():
    """The plain-XLA layer the layer row compares against computes what
    dsa_attention computes (its jnp paths): the same indices and, row by
    row, the same KL; gradients of sum(out * g) + mean(kl) to every input
    within bf16's rounding of P; and, with g = 0, none reaching q or kv
    (the target is stop_gradient)."""
    import jax_attn_dist
    from dsa_bench import composed_step, dsa_problem, layer_keywords, layer_step, plain_ops

    dims = (16, 40, 4, 32, 16, 8, 4, 16)
    kw = layer_keywords(dims)
    q, kv, iq, ik, w, g = dsa_problem(dims, seed=3)
    topk, mla, indexer_loss = plain_ops(kw)
    idx = topk(iq, ik, w)
    out, lse = mla(q, kv, idx)
    ref = jax_attn_dist.dsa_attention(q, kv, iq, ik, w, implementation="xla", **kw)
    assert np.array_equal(np.asarray(idx), np.asarray(ref.indices))
    kl = np.asarray(indexer_loss(q, kv, lse, iq, ik, w, idx))
    assert np.abs(kl - np.asarray(ref.indexer_kl)).max() < 1e-5 * (1 + np.abs(kl).max())
    _, plain = composed_step(plain_ops(kw))(q, kv, iq, ik, w, g)
    _, jnp_path = layer_step(kw, "xla")(q, kv, iq, ik, w, g)
    for name, a, b in zip(("q", "kv", "index_q", "index_k", "weights"), plain, jnp_path):
        assert oracle.spec_errors(jnp.asarray(a, jnp.float32), np.asarray(b, np.float64))[0] < 1e-2, name
    _, no_out = composed_step(plain_ops(kw))(q, kv, iq, ik, w, jnp.zeros_like(g))
    assert not np.any(np.asarray(no_out[0], np.float32)) and not np.any(np.asarray(no_out[1], np.float32))
    assert np.any(np.asarray(no_out[2], np.float32))


def test_git_commit_marks_a_tree_that_differs_from_its_commit(tmp_path, monkeypatch):
    import subprocess
    monkeypatch.delenv("JAX_ATTN_DIST_COMMIT", raising=False)
    run = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
    run("init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    run("add", "f.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = subprocess.check_output(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], text=True).strip()
    assert bench.git_commit(str(tmp_path)) == head
    (tmp_path / "f.txt").write_text("b\n")
    assert bench.git_commit(str(tmp_path)) == head + "+modified"
    monkeypatch.setenv("JAX_ATTN_DIST_COMMIT", "abc1234")
    assert bench.git_commit(str(tmp_path)) == "abc1234"
