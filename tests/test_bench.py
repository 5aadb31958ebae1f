"""The benchmark's own pieces that run anywhere: the plain-XLA indexer loss
it compares against computes SPEC §5, and the plot is drawn from a results
file. (The timings themselves need a GPU: benchmarks/bench.py.)"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from inputs import make_indexer_inputs, seed_of
from jax_attn_dist import oracle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def test_ncu_stall_summary_reads_a_recorded_profile():
    """tools/ncu_stalls.py on session 14's recorded profiles (PERFORMANCE.md §19):
    the shipped backward's consumer spends about 30 % of its samples issuing
    reductions; the build without reductions has no such loop."""
    import subprocess
    import sys

    def run(name):
        path = os.path.join(ROOT, "benchmarks", "results", f"ncu_session14_bwd_source_{name}.csv.gz")
        return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ncu_stalls.py"), path, "--top", "3"],
                              check=True, capture_output=True, text=True).stdout

    shipped, no_reductions = run("shipped"), run("share_0")
    line = next(l for l in shipped.splitlines() if l.startswith("reduction-issue loop"))
    assert "30.1 % of the consumer's" in line, shipped
    assert "reduction-issue loop" not in no_reductions, no_reductions
    assert no_reductions.startswith("samples 132960: consumer 54.4 %"), no_reductions


def test_ncu_stall_summary_counts_attn_dist_mbarrier_waits():
    """tools/ncu_stalls.py on session 17's attn_dist profiles (PERFORMANCE.md §27):
    the consumers spend 50 % of their samples in mbarrier waits (nearly all for
    a full stage, the rest for Q) at 128k (HBM), 18 % at v32-h64 and 10 % at
    v32-h128."""
    import subprocess
    import sys

    def consumer_waits(shape):
        path = os.path.join(ROOT, "benchmarks", "results", f"ncu_session17_source_{shape}.csv.gz")
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ncu_stalls.py"), path, "--top", "3"],
                             check=True, capture_output=True, text=True).stdout
        return next(l for l in out.splitlines() if l.startswith("consumer in mbarrier waits")), out

    for shape, share in (("v32-h128", "10.0"), ("v32-h64", "18.1"), ("v32-h128-128k", "50.4")):
        line, out = consumer_waits(shape)
        assert line == f"consumer in mbarrier waits: {share} % of its samples", out


def test_clock_probe_reads_nvidia_smi_samples():
    """tools/clock_probe.py's parser (PERFORMANCE.md §27) on the line format
    nvidia-smi writes, and on the lines it must skip."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("clock_probe", os.path.join(ROOT, "tools", "clock_probe.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    s = probe.parse_sample("2026/11/23 08:40:01.250, 1605, 690.17, 54, Active, Not Active, Not Active\n")
    assert s[1:] == (1605.0, 690.17, 54.0, True, False, False)
    t = probe.parse_sample("2026/11/23 08:40:02.500, 1980, 514.2, 50, Not Active, Not Active, Not Active")
    assert abs(t[0] - s[0] - 1.25) < 1e-6 and t[4] is False
    assert probe.parse_sample("") is None
    assert probe.parse_sample("2026/11/23 08:40:01.250, [N/A], 690.17, 54, Active, Not Active, Not Active") is None
