"""XLA command buffers (CUDA graphs) around the kernels: attn_dist and the
indexer_kl forward, then a deterministic training step of the DSA layer
(its five ops' kernels: indexer_topk, the sparse MLA forward and backward,
attn_dist, the indexer loss forward and backward). Each custom call is
captured into a command buffer, and what the kernels write has the same
bits as without one (the step's loss, XLA's own reduction, within rounding).
GPU only (see conftest.py); each run is a child process with its own XLA
flags."""

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

# where did the kernels run?
from kernel_profile import write_graph_summary
write_graph_summary(lambda run: f(*sets[run % 2]), sys.argv[3],
                    {"kernel": "attn_dist_kernel", "indexer": "indexer_fwd_kernel"})
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
from kernel_profile import write_graph_summary
import jax_attn_dist

out_npz, hlo_path, prof_dir = sys.argv[1:4]
assert jax.default_backend() == "gpu" and jax_attn_dist.kernel_available()
shape = dict(B=2, S=128, N=512, H=128, D=576, d_v=512, HI=64, DI=128, topk=256, dtype=jnp.bfloat16)
sets, static = [], None
out_dims = tuple(shape[k] for k in ("B", "S", "H", "d_v"))
for tag in ("a", "b"):
    arrays, kw = make_dsa_inputs(seed_of("gpu-cmdbuf-dsa", tag), **shape, q_start_index="batch")
    kw_static, traced = split_arrays(kw)
    static = static or kw_static  # set a's scales for both sets: one executable
    g = jnp.asarray(np.random.default_rng(len(sets)).standard_normal(out_dims), jnp.float32)
    sets.append((*arrays, traced["q_start_index"], g))

def loss(q, kv, iq, ik, w, starts, g):
    r = jax_attn_dist.dsa_attention(q, kv, iq, ik, w, q_start_index=starts, deterministic=True,
                                    implementation="cuda", **static)
    terms = r.out.astype(jnp.float32) * g
    # the loss, and the size of the terms it sums (for the tolerance of a sum in another order)
    return jnp.sum(terms) + jnp.mean(r.indexer_kl), (r, jnp.sum(jnp.abs(terms)))

step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
open(hlo_path, "w").write(step.lower(*sets[0]).compile().as_text())
results = {}
grad_names = ("d_q", "d_kv", "d_index_q", "d_index_k", "d_weights")
for run in range(6):  # graph capture / instantiation, then replays with other buffers
    (value, (r, terms_abs)), grads = step(*sets[run % 2])
    results[f"value{run}"] = np.asarray(value, np.float32)
    results[f"termsabs{run}"] = np.asarray(terms_abs, np.float32)
    for name, x in (("out", r.out), ("kl", r.indexer_kl), ("lse", r.lse), *zip(grad_names, grads)):
        results[f"{name}{run}"] = np.asarray(x.astype(jnp.float32))
    results[f"indices{run}"] = np.asarray(r.indices)
np.savez(out_npz, **results)

# where did the kernels run?
write_graph_summary(lambda run: step(*sets[run % 2]), prof_dir,
                    {"topk": "indexer_topk", "mla_fwd": "sparse_mla_fwd_kernel", "mla_bwd": "sparse_mla_bwd_kernel",
                     "attn_dist": "attn_dist_kernel", "indexer_fwd": "indexer_fwd_kernel",
                     "indexer_bwd": "indexer_bwd_kernel"})
"""


def _run_child(flags: str, workdir: str, tag: str, child: str):
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


def _child_runs(child: str, tag: str):
    """The child run with command buffers and without, in a temporary directory."""
    with tempfile.TemporaryDirectory() as d:
        on, hlo_on, dump_on, prof_on = _run_child(CB_FLAGS, d, f"{tag}on", child)
        off, hlo_off, dump_off, prof_off = _run_child(NO_CB_FLAGS, d, f"{tag}off", child)
        yield dict(on=on, off=off, hlo_on=hlo_on, hlo_off=hlo_off, prof_on=prof_on, prof_off=prof_off,
                   dumps_on=_dump_texts(dump_on), dumps_off=_dump_texts(dump_off))


@pytest.fixture(scope="module")
def cmdbuf_runs():
    yield from _child_runs(_CHILD, "")


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


def _assert_captured(runs: dict, target: str, profile_key: str) -> None:
    """With command buffers on, the custom call is inside one: evidence in the
    optimised HLO, in XLA's dumps, or in a profile (the kernel's activity
    carries a CUDA graph id); with them off, the same searches find nothing
    (a control for the searches themselves)."""
    assert target in runs["hlo_on"] and target in runs["hlo_off"]
    in_hlo, in_dumps = _capture_evidence(runs["hlo_on"], runs["dumps_on"], target)
    off_hlo, off_dumps = _capture_evidence(runs["hlo_off"], runs["dumps_off"], target)
    prof_on, prof_off = runs["prof_on"], runs["prof_off"]
    comps = [n for n in _computations(runs["hlo_on"]) if "command_buffer" in n]
    assert in_hlo or in_dumps or prof_on.get(f"{profile_key}_events_in_graph", 0) > 0, (
        f"no evidence that {target} was captured into a command buffer.\n"
        f"command_buffer computations in the HLO: {comps}\n"
        f"profile with command buffers: {prof_on}\nprofile without: {prof_off}\n"
        f"dump files: {sorted(runs['dumps_on'])[:60]}"
    )
    assert not off_hlo and not off_dumps, f"the search also matches without command buffers: {off_hlo} {off_dumps}"
    assert prof_off.get(f"{profile_key}_events_in_graph", 0) == 0, f"graph ids without command buffers: {prof_off}"


def test_command_buffer_captures_the_custom_call(cmdbuf_runs):
    _assert_captured(cmdbuf_runs, FFI_TARGET, "kernel")


def test_command_buffer_captures_the_indexer_kernel(cmdbuf_runs):
    _assert_captured(cmdbuf_runs, FFI_INDEXER_FWD, "indexer")


# ----------------------------------------------------------------------------
# the DSA layer's training step
# ----------------------------------------------------------------------------

DSA_TARGETS = {  # FFI target: its kernel's key in the child's profile summary
    topk_contract.FFI_TARGET: "topk",
    mla_contract.FFI_TARGET: "mla_fwd",
    mla_contract.BWD_FFI_TARGET: "mla_bwd",
    FFI_TARGET: "attn_dist",
    FFI_INDEXER_FWD: "indexer_fwd",
    indexer_contract.BWD_FFI_TARGET: "indexer_bwd",
}


@pytest.fixture(scope="module")
def dsa_cmdbuf_runs():
    require_ffi_targets(*DSA_TARGETS)
    yield from _child_runs(_DSA_CHILD, "dsa_")


def test_dsa_step_command_buffers_give_identical_bits(dsa_cmdbuf_runs):
    """Everything but the loss is a kernel's output (with only elementwise
    work after it; the target's sums run in a fixed order): bit for bit. The
    loss is XLA's reduction over out * g, compiled under other flags: within
    float32 rounding of the size of its terms (a sum in another order)."""
    on, off = dsa_cmdbuf_runs["on"], dsa_cmdbuf_runs["off"]
    assert on.keys() == off.keys()
    for key in sorted(on):
        a, b = on[key], off[key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if key.startswith(("value", "termsabs")):
            run = key[len(key.rstrip("0123456789")):]
            tol = 2e-6 * float(off[f"termsabs{run}"])
            np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"{key}: command-buffer run differs")
        else:
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{key}: command-buffer run differs"
    names = {key.rstrip("0123456789") for key in on}
    for run in range(2, 6):  # replays of one executable repeat the first runs bit for bit (deterministic mode)
        for name in names:
            assert np.array_equal(on[f"{name}{run}"].view(np.uint32), on[f"{name}{run % 2}"].view(np.uint32)), \
                f"{name}: replay {run} differs"
    for name in ("out", "indices", "d_kv", "d_index_k"):
        assert not np.array_equal(on[f"{name}0"], on[f"{name}1"]), f"{name}: both input sets gave the same"


@pytest.mark.parametrize("target", sorted(DSA_TARGETS))
def test_command_buffer_captures_the_dsa_kernels(dsa_cmdbuf_runs, target):
    _assert_captured(dsa_cmdbuf_runs, target, DSA_TARGETS[target])
