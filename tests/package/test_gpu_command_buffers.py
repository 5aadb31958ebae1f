"""XLA command buffers (CUDA graphs) around the kernels: attn_dist and the
indexer_kl forward, then a training step of the DSA layer (indexer_topk,
the sparse MLA forward and backward, attn_dist and the indexer loss). The
custom calls are captured into a command buffer and give the same bits as
without one. GPU only (see conftest.py); each run is a child process with
its own XLA flags."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from inputs import require_ffi_targets
from jax_attn_dist.ops.attn_dist.contract import FFI_TARGET
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist.ops.indexer.contract import FWD_FFI_TARGET as FFI_INDEXER_FWD
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from jax_attn_dist.ops.sparse_mla import contract as mla_contract

pytestmark = pytest.mark.gpu

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
ROOT = os.path.dirname(os.path.dirname(SUPPORT))


# ----------------------------------------------------------------------------
# command buffers (CUDA graphs)
# ----------------------------------------------------------------------------

# XLA runs command buffers op by op while a profiler is attached unless told
# otherwise; the children profile a few calls to see where the kernel ran.
_PROFILE_FLAGS = " --xla_enable_command_buffers_during_profiling=true"
CB_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" + _PROFILE_FLAGS
NO_CB_FLAGS = "--xla_gpu_enable_command_buffer=" + _PROFILE_FLAGS  # empty list: no command buffers

_CHILD = r"""
import sys
import numpy as np
import jax, jax.numpy as jnp
from inputs import make_indexer_inputs, make_inputs, seed_of
import jax_attn_dist

out_npz, hlo_path = sys.argv[1], sys.argv[2]
assert jax.default_backend() == "gpu" and jax_attn_dist.kernel_available()
sets = []
ikw = dict(scale=1.0, causal=True, k_stride=1)
for tag in ("a", "b"):
    q, k, idx, lse, kw = make_inputs(seed_of("gpu-cmdbuf", tag), B=2, S=64, H=128, D=576, N=500, T=256,
                                     q_start_index="batch", lse_noise=0.25)
    qs = jnp.asarray(kw.pop("q_start_index"), jnp.int32)
    iq, ik, w, idx2, tgt, ix = make_indexer_inputs(seed_of("gpu-cmdbuf-indexer", tag), B=2, S=64, HI=64, DI=128,
                                                   N=500, T=256, q_start_index="batch", **ikw)
    sets.append((q, k, idx, lse, qs, iq, ik, w, idx2, tgt, jnp.asarray(ix["q_start_index"], jnp.int32)))

@jax.jit
def f(q, k, i, l, s, iq, ik, w, i2, t, s2):
    out = jax_attn_dist.attn_dist(q * 2, k, i, l - 1.0, q_start_index=s + 0, implementation="cuda", **kw)
    kl = jax_attn_dist.indexer_kl(iq, ik, w * 0.5, i2, t, q_start_index=s2 + 0, implementation="cuda", **ikw)
    return out, out.sum(axis=-1), kl  # fusions before and after the custom calls

open(hlo_path, "w").write(f.lower(*sets[0]).compile().as_text())
results = {}
for run in range(6):  # graph capture / instantiation, then replays with other buffers
    out, sums, kl = f(*sets[run % 2])
    results[f"out{run}"] = np.asarray(out)
    results[f"sum{run}"] = np.asarray(sums)
    results[f"kl{run}"] = np.asarray(kl)
np.savez(out_npz, **results)

# where did the kernel run? A profile of a few more calls: kernel activity
# launched from a CUDA graph carries a graph id; graph launches show up as API calls
import glob, gzip, json, os
prof_dir = sys.argv[3]
try:
    with jax.profiler.trace(prof_dir):
        for run in range(4):
            jax.block_until_ready(f(*sets[run % 2]))
    files = sorted(glob.glob(os.path.join(prof_dir, "**", "*.trace.json.gz"), recursive=True))
    with gzip.open(files[-1]) as fh:
        events = json.load(fh)["traceEvents"]
    kernel = [e for e in events if "attn_dist_kernel" in str(e.get("name", ""))]
    indexer = [e for e in events if "indexer_fwd_kernel" in str(e.get("name", ""))]
    in_graph = lambda e: any("graph" in str(key).lower() and str(val) not in ("0", "", "None", "-1")
                             for key, val in (e.get("args") or {}).items())
    summary = dict(
        kernel_events=len(kernel),
        kernel_events_in_graph=sum(map(in_graph, kernel)),
        indexer_events=len(indexer),
        indexer_events_in_graph=sum(map(in_graph, indexer)),
        graph_launch_events=sum("graphlaunch" in str(e.get("name", "")).lower() for e in events),
        kernel_args=[e.get("args") for e in kernel[:4]],
        error=None,
    )
except Exception as e:  # a profiler problem must not hide the results above
    summary = dict(error=repr(e))
with open(prof_dir + ".json", "w") as fh:
    json.dump(summary, fh, default=str)
"""


# A deterministic training step of the layer (every op's kernel; dkv and the
# indexer's gradients by fixed-point sums, so that every output repeats bit
# for bit), on two input sets of the same shapes and static arguments.
_DSA_CHILD = r"""
import sys
import numpy as np
import jax, jax.numpy as jnp
from dsa_cases import make_dsa_inputs, split_arrays
from inputs import seed_of
import jax_attn_dist

out_npz, hlo_path, prof_dir = sys.argv[1:4]
assert jax.default_backend() == "gpu" and jax_attn_dist.kernel_available()
shape = dict(B=2, S=128, N=512, H=128, D=576, d_v=512, HI=64, DI=128, topk=256, dtype=jnp.bfloat16)
sets, static = [], None
for tag in ("a", "b"):
    arrays, kw = make_dsa_inputs(seed_of("gpu-cmdbuf-dsa", tag), **shape, q_start_index="batch")
    kw_static, traced = split_arrays(kw)
    static = static or kw_static  # one executable for both sets
    g = jnp.asarray(np.random.default_rng(len(sets)).standard_normal((2, 128, 128, 512)), jnp.float32)
    sets.append((*arrays, traced["q_start_index"], g))

def loss(q, kv, iq, ik, w, starts, g):
    r = jax_attn_dist.dsa_attention(q, kv, iq, ik, w, q_start_index=starts, deterministic=True, **static)
    return jnp.sum(r.out.astype(jnp.float32) * g) + jnp.mean(r.indexer_kl), r

step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
open(hlo_path, "w").write(step.lower(*sets[0]).compile().as_text())
results = {}
for run in range(6):  # graph capture / instantiation, then replays with other buffers
    (value, r), grads = step(*sets[run % 2])
    results[f"value{run}"] = np.asarray(value, np.float32)
    grad_names = ("d_q", "d_kv", "d_index_q", "d_index_k", "d_weights")
    for name, x in (("out", r.out), ("kl", r.indexer_kl), ("lse", r.lse), *zip(grad_names, grads)):
        results[f"{name}{run}"] = np.asarray(x.astype(jnp.float32))
    results[f"indices{run}"] = np.asarray(r.indices)
np.savez(out_npz, **results)

# where did the kernels run? (as in the first child)
import glob, gzip, json, os
kernels = ("indexer_topk", "sparse_mla_fwd_kernel", "sparse_mla_bwd_kernel")
try:
    with jax.profiler.trace(prof_dir):
        for run in range(4):
            jax.block_until_ready(step(*sets[run % 2]))
    files = sorted(glob.glob(os.path.join(prof_dir, "**", "*.trace.json.gz"), recursive=True))
    with gzip.open(files[-1]) as fh:
        events = json.load(fh)["traceEvents"]
    in_graph = lambda e: any("graph" in str(key).lower() and str(val) not in ("0", "", "None", "-1")
                             for key, val in (e.get("args") or {}).items())
    summary = dict(error=None)
    for name in kernels:
        hits = [e for e in events if name in str(e.get("name", ""))]
        summary[f"{name}_events"] = len(hits)
        summary[f"{name}_events_in_graph"] = sum(map(in_graph, hits))
except Exception as e:  # a profiler problem must not hide the results above
    summary = dict(error=repr(e))
with open(prof_dir + ".json", "w") as fh:
    json.dump(summary, fh, default=str)
"""


def _run_child(flags: str, workdir: str, tag: str, child: str = _CHILD):
    env = dict(os.environ)
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(("--xla_gpu_enable_command_buffer",
                                                                              "--xla_gpu_graph_min_graph_size",
                                                                              "--xla_dump_to"))]
    dump = os.path.join(workdir, f"dump_{tag}")
    env["XLA_FLAGS"] = " ".join(kept + flags.split() + [f"--xla_dump_to={dump}"])
    env["PYTHONPATH"] = os.pathsep.join([ROOT, SUPPORT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    npz, hlo = os.path.join(workdir, f"{tag}.npz"), os.path.join(workdir, f"{tag}.hlo.txt")
    prof = os.path.join(workdir, f"profile_{tag}")
    r = subprocess.run([sys.executable, "-c", child, npz, hlo, prof], env=env, cwd=workdir,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"child ({flags}) failed:\n{r.stderr[-4000:]}"
    with open(hlo) as fh, open(prof + ".json") as fp:
        return dict(np.load(npz)), fh.read(), dump, json.load(fp)


def _dump_texts(dump_dir):
    texts = {}
    for root, _, files in os.walk(dump_dir):
        for name in files:
            if name.endswith(".txt"):
                with open(os.path.join(root, name), errors="replace") as fh:
                    texts[name] = fh.read()
    return texts


@pytest.fixture(scope="module")
def cmdbuf_runs():
    with tempfile.TemporaryDirectory() as d:
        on, hlo_on, dump_on, prof_on = _run_child(CB_FLAGS, d, "on")
        off, hlo_off, dump_off, prof_off = _run_child(NO_CB_FLAGS, d, "off")
        yield dict(on=on, off=off, hlo_on=hlo_on, hlo_off=hlo_off, prof_on=prof_on, prof_off=prof_off,
                   dumps_on=_dump_texts(dump_on), dumps_off=_dump_texts(dump_off))


def test_command_buffers_give_identical_bits(cmdbuf_runs):
    on, off = cmdbuf_runs["on"], cmdbuf_runs["off"]
    assert on.keys() == off.keys()
    for key in sorted(on):
        a, b = on[key], off[key]
        assert a.shape == b.shape and a.dtype == b.dtype == np.float32
        if key.startswith(("out", "kl")):  # the custom calls' outputs: bit for bit
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{key}: command-buffer run differs"
        else:  # XLA's own reduction after it, compiled under other flags, may sum in another order
            np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=f"{key}: command-buffer run differs")
    # replays on the same inputs repeat the first run bit for bit
    for run in range(2, 6):
        for name in ("out", "kl"):
            assert np.array_equal(on[f"{name}{run}"].view(np.uint32), on[f"{name}{run % 2}"].view(np.uint32))
    assert not np.array_equal(on["out0"], on["out1"]) and not np.array_equal(on["kl0"], on["kl1"])


def _computations(hlo: str):
    """{computation name: body text} of an HLO module's text."""
    comps, name, body = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if name is None and m:
            name, body = m.group(1), []
        elif name is not None and line.strip() == "}":
            comps[name] = "\n".join(body)
            name = None
        elif name is not None:
            body.append(line)
    return comps


_CMD_BUFFER = re.compile(r"(?<!enable_)command[_ ]?buffer", re.IGNORECASE)


def _capture_evidence(hlo: str, dumps: dict, target: str = FFI_TARGET):
    """Where an FFI custom call shows up inside a command buffer: HLO
    computations named command_buffer* that contain it (XLA's HLO-level
    command-buffer scheduling), and dump files that mention both (command
    buffers formed on thunks)."""
    in_hlo = [n for n, body in _computations(hlo).items() if "command_buffer" in n and f'"{target}"' in body]
    in_dumps = [n for n, text in dumps.items() if target in text and _CMD_BUFFER.search(text)]
    return in_hlo, in_dumps


def test_command_buffer_captures_the_custom_call(cmdbuf_runs):
    """With command buffers on, the custom call is inside one: evidence in the
    optimised HLO, in XLA's dumps, or in a profile (the kernel's activity
    carries a CUDA graph id); with them off, the same searches find nothing
    (a control for the searches themselves)."""
    assert FFI_TARGET in cmdbuf_runs["hlo_on"] and FFI_TARGET in cmdbuf_runs["hlo_off"]
    in_hlo, in_dumps = _capture_evidence(cmdbuf_runs["hlo_on"], cmdbuf_runs["dumps_on"])
    off_hlo, off_dumps = _capture_evidence(cmdbuf_runs["hlo_off"], cmdbuf_runs["dumps_off"])
    prof_on, prof_off = cmdbuf_runs["prof_on"], cmdbuf_runs["prof_off"]
    in_profile = prof_on.get("kernel_events_in_graph", 0) > 0
    comps = [n for n in _computations(cmdbuf_runs["hlo_on"]) if "command_buffer" in n]
    assert in_hlo or in_dumps or in_profile, (
        "no evidence that the custom call was captured into a command buffer.\n"
        f"command_buffer computations in the HLO: {comps}\n"
        f"profile with command buffers: {prof_on}\nprofile without: {prof_off}\n"
        f"dump files: {sorted(cmdbuf_runs['dumps_on'])[:60]}"
    )
    assert not off_hlo and not off_dumps, f"the search also matches without command buffers: {off_hlo} {off_dumps}"
    assert prof_off.get("kernel_events_in_graph", 0) == 0, f"graph ids without command buffers: {prof_off}"


def test_command_buffer_captures_the_indexer_kernel(cmdbuf_runs):
    """The same evidence for the indexer_kl forward's custom call."""
    assert FFI_INDEXER_FWD in cmdbuf_runs["hlo_on"]
    in_hlo, in_dumps = _capture_evidence(cmdbuf_runs["hlo_on"], cmdbuf_runs["dumps_on"], FFI_INDEXER_FWD)
    off_hlo, off_dumps = _capture_evidence(cmdbuf_runs["hlo_off"], cmdbuf_runs["dumps_off"], FFI_INDEXER_FWD)
    prof_on, prof_off = cmdbuf_runs["prof_on"], cmdbuf_runs["prof_off"]
    assert in_hlo or in_dumps or prof_on.get("indexer_events_in_graph", 0) > 0, (
        f"no evidence that the indexer custom call was captured.\nprofile on: {prof_on}\noff: {prof_off}")
    assert not off_hlo and not off_dumps
    assert prof_off.get("indexer_events_in_graph", 0) == 0, f"graph ids without command buffers: {prof_off}"


# ----------------------------------------------------------------------------
# the DSA layer's training step
# ----------------------------------------------------------------------------

DSA_KERNELS = {  # FFI target: the kernel name its profile events carry
    topk_contract.FFI_TARGET: "indexer_topk",
    mla_contract.FFI_TARGET: "sparse_mla_fwd_kernel",
    mla_contract.BWD_FFI_TARGET: "sparse_mla_bwd_kernel",
}


@pytest.fixture(scope="module")
def dsa_cmdbuf_runs():
    require_ffi_targets(*DSA_KERNELS, indexer_contract.BWD_FFI_TARGET)
    with tempfile.TemporaryDirectory() as d:
        on, hlo_on, dump_on, prof_on = _run_child(CB_FLAGS, d, "dsa_on", _DSA_CHILD)
        off, hlo_off, dump_off, prof_off = _run_child(NO_CB_FLAGS, d, "dsa_off", _DSA_CHILD)
        yield dict(on=on, off=off, hlo_on=hlo_on, hlo_off=hlo_off, prof_on=prof_on, prof_off=prof_off,
                   dumps_on=_dump_texts(dump_on), dumps_off=_dump_texts(dump_off))


# What the kernels write, bit for bit with and without command buffers; the
# loss value is XLA's own reduction, and the indexer's input gradients pass
# through XLA's elementwise work and reductions, compiled under other flags.
_DSA_KERNEL_OUTPUTS = ("out", "kl", "lse", "indices", "d_q", "d_kv")


def test_dsa_step_command_buffers_give_identical_bits(dsa_cmdbuf_runs):
    on, off = dsa_cmdbuf_runs["on"], dsa_cmdbuf_runs["off"]
    assert on.keys() == off.keys()
    for key in sorted(on):
        a, b = on[key], off[key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if key.rstrip("0123456789") in _DSA_KERNEL_OUTPUTS:
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{key}: command-buffer run differs"
        else:  # summed in another order at most: within float32 rounding of the largest entry
            tol = (1e-4 if key.startswith("value") else 1e-5) * float(np.abs(b).max())
            np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"{key}: command-buffer run differs")
    names = {key.rstrip("0123456789") for key in on}
    for run in range(2, 6):  # replays of one executable repeat the first runs bit for bit (deterministic mode)
        for name in names:
            assert np.array_equal(on[f"{name}{run}"].view(np.uint32), on[f"{name}{run % 2}"].view(np.uint32)), \
                f"{name}: replay {run} differs"
    for name in ("out", "indices", "d_kv"):
        assert not np.array_equal(on[f"{name}0"], on[f"{name}1"]), f"{name}: both input sets gave the same"


@pytest.mark.parametrize("target", sorted(DSA_KERNELS))
def test_command_buffer_captures_the_dsa_kernels(dsa_cmdbuf_runs, target):
    """The evidence of test_command_buffer_captures_the_custom_call for the
    top-k and both sparse MLA kernels in the layer's step."""
    runs, kernel = dsa_cmdbuf_runs, DSA_KERNELS[target]
    assert target in runs["hlo_on"] and target in runs["hlo_off"]
    in_hlo, in_dumps = _capture_evidence(runs["hlo_on"], runs["dumps_on"], target)
    off_hlo, off_dumps = _capture_evidence(runs["hlo_off"], runs["dumps_off"], target)
    prof_on, prof_off = runs["prof_on"], runs["prof_off"]
    assert in_hlo or in_dumps or prof_on.get(f"{kernel}_events_in_graph", 0) > 0, (
        f"no evidence that {target} was captured.\nprofile on: {prof_on}\noff: {prof_off}")
    assert not off_hlo and not off_dumps, f"the search also matches without command buffers: {off_hlo} {off_dumps}"
    assert prof_off.get(f"{kernel}_events_in_graph", 0) == 0, f"graph ids without command buffers: {prof_off}"
