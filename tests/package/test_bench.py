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

