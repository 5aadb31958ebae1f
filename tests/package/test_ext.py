"""The compiled extension's loading rules (jax_attn_dist/_core/ext.py): build
identity, registration errors, and JAX_ATTN_DIST_REQUIRE_GPU. CPU tests."""

from __future__ import annotations

import ctypes
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types
import warnings

import jax
import pytest

from jax_attn_dist.ops.attn_dist import contract as attn_contract
from jax_attn_dist.ops.indexer import contract as indexer_contract
from jax_attn_dist.ops.indexer_topk import contract as topk_contract
from jax_attn_dist.ops.sparse_mla import contract as sparse_mla_contract
from jax_attn_dist._core import ext, fixed_point

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)

_NOOP_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda frame: None)


def _capsule():
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.cast(_NOOP_HANDLER, ctypes.c_void_p), None, None)


def _cuda_plugin_installed():
    import importlib.metadata as md

    names = ((d.metadata["Name"] or "").lower().replace("_", "-") for d in md.distributions())
    return any(n.startswith("jax-cuda") for n in names)


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(ext, "_state", None)
    monkeypatch.delenv(ext.REQUIRE_GPU_ENV, raising=False)


def _replace_extension_module(monkeypatch, module):
    """``from jax_attn_dist import _cuda`` gives ``module`` (None: raises
    ImportError), also where a real extension sits in the source tree and
    was imported already (then the package has the attribute)."""
    import jax_attn_dist

    monkeypatch.setitem(sys.modules, "jax_attn_dist._cuda", module)
    if module is None:
        monkeypatch.delattr(jax_attn_dist, "_cuda", raising=False)
    else:
        monkeypatch.setattr(jax_attn_dist, "_cuda", module, raising=False)


def fake_extension(monkeypatch, registrations, build_id=None):
    """Installs a fake jax_attn_dist._cuda (its build id matches the checkout
    unless given)."""
    fake = types.ModuleType("jax_attn_dist._cuda")
    fake.registrations = registrations
    checkout = ext.source_checkout()
    fake.build_id = lambda: build_id if build_id is not None else ext.build_id_of(checkout) if checkout else "x"
    _replace_extension_module(monkeypatch, fake)
    return fake


# ----------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------


@pytest.mark.skipif(
    _cuda_plugin_installed(),
    reason="a CUDA plugin forwards the registration to XLA, which calls the handler: needs a real one",
)
def test_ext_registers_capsules_for_cuda(monkeypatch, fresh_state):
    """Registering a CUDA FFI target on a CPU-only jax is accepted (stored)."""
    fake_extension(monkeypatch, lambda: {"jax_attn_dist_fwd": _capsule()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ext.extension_registered()
    assert "jax_attn_dist_fwd" in ext.kernel_unavailable_reason()


def _broken():
    raise RuntimeError("boom")


def test_registration_failure_warns_once_and_falls_back(monkeypatch, fresh_state):
    fake_extension(monkeypatch, _broken)
    with pytest.warns(RuntimeWarning, match="boom"):
        assert not ext.extension_registered()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert not ext.extension_registered()
    assert "boom" in ext.kernel_unavailable_reason()


def test_registration_failure_raises_when_the_kernel_is_required(monkeypatch, fresh_state):
    fake_extension(monkeypatch, _broken)
    with pytest.raises(RuntimeError, match="required but.*boom"):
        ext.extension_registered(required=True)


def test_registration_failure_raises_under_require_gpu(monkeypatch, fresh_state):
    monkeypatch.setenv(ext.REQUIRE_GPU_ENV, "1")
    fake_extension(monkeypatch, _broken)
    with pytest.raises(RuntimeError, match="boom"):
        ext.extension_registered()


def test_implementation_cuda_never_swallows_a_registration_error(monkeypatch, fresh_state):
    import jax.numpy as jnp

    from jax_attn_dist import attn_dist

    fake_extension(monkeypatch, _broken)
    q = jnp.zeros((4, 64, 576), jnp.bfloat16)
    k = jnp.zeros((8, 1, 576), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="boom"):
        attn_dist(q, k, jnp.zeros((4, 1, 8), jnp.int32), jnp.zeros((4, 64), jnp.float32), lse_base="2", sm_scale=0.1,
                  implementation="cuda")


def test_missing_extension_is_no_problem(monkeypatch, fresh_state):
    _replace_extension_module(monkeypatch, None)  # import raises ImportError
    monkeypatch.setattr(ext, "_installed_extension", lambda: None)  # nor an installed copy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ext.extension_registered()
        assert not ext.extension_registered(required=True)  # absent, not broken: the caller says what it needs
    assert "not built" in ext.kernel_unavailable_reason()


def test_require_gpu_value_is_checked(monkeypatch):
    monkeypatch.setenv(ext.REQUIRE_GPU_ENV, "yes")
    with pytest.raises(ValueError, match="integer"):
        ext.required_gpus()
    monkeypatch.setenv(ext.REQUIRE_GPU_ENV, "2")
    assert ext.required_gpus() == 2
    monkeypatch.setenv(ext.REQUIRE_GPU_ENV, "")
    assert ext.required_gpus() == 0


# ----------------------------------------------------------------------------
# build identity
# ----------------------------------------------------------------------------


def test_build_id_tracks_csrc_and_cmakelists(tmp_path):
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    shutil.copy(os.path.join(ROOT, "CMakeLists.txt"), tmp_path / "CMakeLists.txt")
    for variants in pathlib.Path(ROOT, "jax_attn_dist", "ops").glob("*/variants.py"):
        target = tmp_path / variants.relative_to(ROOT)
        target.parent.mkdir(parents=True)
        shutil.copy(variants, target)
    base = ext.build_id_of(tmp_path)
    assert base == ext.build_id_of(ROOT)
    variants = tmp_path / "jax_attn_dist" / "ops" / "attn_dist" / "variants.py"
    original = variants.read_text()
    variants.write_text(original + "\n# an edit\n")
    assert ext.build_id_of(tmp_path) != base  # the variant lists drive the instantiations
    variants.write_text(original)
    kernel = tmp_path / "csrc" / "attn_dist" / "kernel.cuh"
    kernel.write_text(kernel.read_text() + "\n// an edit\n")
    edited = ext.build_id_of(tmp_path)
    assert edited != base
    (tmp_path / "csrc" / "new.h").write_text("")
    assert ext.build_id_of(tmp_path) not in (base, edited)
    (tmp_path / "CMakeLists.txt").write_text("# other\n")
    assert len({base, edited, ext.build_id_of(tmp_path)}) == 3


def test_a_source_checkout_is_recognised():
    """Running from this checkout (tests/ beside CMakeLists.txt and csrc/),
    the package knows it: the extension's build identity is then compared
    with the checkout's (a stale build warns, or raises when required)."""
    import jax_attn_dist

    if pathlib.Path(jax_attn_dist.__file__).resolve().parents[1] != pathlib.Path(ROOT).resolve():
        pytest.skip("jax_attn_dist is imported from an installed package, not from this checkout")
    assert ext.source_checkout() == pathlib.Path(ROOT).resolve()


def test_stale_build_warns(monkeypatch, fresh_state):
    fake_extension(monkeypatch, lambda: {"jax_attn_dist_fwd": _capsule()}, build_id="0" * 64)
    if ext.source_checkout() is None:
        pytest.skip("runs from an installed package: there is no checkout to compare with")
    if _cuda_plugin_installed():
        pytest.skip("a CUDA plugin would call the fake handler")
    with pytest.warns(RuntimeWarning, match="built from other sources"):
        assert ext.extension_registered()  # still used, with a warning


def test_stale_build_is_an_error_when_required(monkeypatch, fresh_state):
    if ext.source_checkout() is None:
        pytest.skip("runs from an installed package: there is no checkout to compare with")
    monkeypatch.setenv(ext.REQUIRE_GPU_ENV, "1")
    fake_extension(monkeypatch, lambda: {}, build_id="0" * 64)
    with pytest.raises(RuntimeError):
        ext.extension_registered()


def test_the_built_extension_matches_this_checkout():
    """CI builds the extension from this checkout (pip install .): the binary
    the tests load must carry the checkout's build identity, register exactly
    the FFI targets the ops' contracts name and serve the head dims it declares."""
    module = ext.extension_module()
    if module is None:
        pytest.skip(f"no compiled extension: {ext.kernel_unavailable_reason()}")
    checkout = ext.source_checkout()
    if checkout is not None:
        assert module.build_id() == ext.build_id_of(checkout), "the loaded extension is stale: pip install ."
    production = {attn_contract.FFI_TARGET, indexer_contract.FWD_FFI_TARGET, indexer_contract.BWD_FFI_TARGET,
                  indexer_contract.BWD_BOUND_FFI_TARGET, indexer_contract.BWD_FIXED_FFI_TARGET,
                  sparse_mla_contract.FFI_TARGET, sparse_mla_contract.BWD_FFI_TARGET,
                  sparse_mla_contract.BWD_BOUND_FFI_TARGET, sparse_mla_contract.BWD_FIXED_FFI_TARGET,
                  fixed_point.LIMBS_TO_FLOAT_TARGET, topk_contract.FFI_TARGET}
    test_only = {attn_contract.FFI_TEST_TARGET, indexer_contract.FWD_FFI_TEST_TARGET, indexer_contract.BWD_FFI_TEST_TARGET,
                 sparse_mla_contract.FFI_TEST_TARGET, sparse_mla_contract.BWD_FFI_TEST_TARGET}
    built_test_targets = getattr(module, "test_targets_built", lambda: True)()
    assert set(module.registrations()) == production | (test_only if built_test_targets else set())
    assert tuple(module.attn_dist_head_dims()) == attn_contract.KERNEL_HEAD_DIMS
    assert tuple(module.indexer_head_dims()) == indexer_contract.KERNEL_HEAD_DIMS
    assert module.indexer_max_heads() == indexer_contract.KERNEL_MAX_HEADS
    assert module.indexer_bwd_max_heads() == indexer_contract.BWD_KERNEL_MAX_HEADS


# ----------------------------------------------------------------------------
# GPU tests cannot pass silently without a GPU
# ----------------------------------------------------------------------------

def _pytest(args, env_extra):
    """pytest in a child process, in one process (-n 0: no xdist workers)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **env_extra)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks a machine without a GPU")
def test_gpu_tests_fail_when_a_gpu_is_required_but_absent():
    """Under JAX_ATTN_DIST_REQUIRE_GPU=2 every GPU test (every test marked
    gpu, in any file of any folder that uses the marker) fails and says why;
    without it, they skip. (JAX_PLATFORMS=cpu hides any GPU.)"""
    marked = re.compile(r"^(pytestmark = pytest\.mark\.gpu|@pytest\.mark\.gpu)", re.M)
    files = sorted(str(p.relative_to(ROOT)) for p in pathlib.Path(TESTS).rglob("test_*.py")
                   if marked.search(p.read_text()))
    assert len(files) >= 8, files  # each op's kernels, SPEC §6's, and the package's
    r = _pytest(["-rfEs", "-m", "gpu", *files], {ext.REQUIRE_GPU_ENV: "2"})
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert " passed" not in out, out[-3000:]
    # the only skip left is the opt-in one (--run-large: 4.4 GB of GPU memory)
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert all("--run-large" in line for line in skips), skips
    assert "needs 1 CUDA GPU(s) visible to jax, found 0" in out and "needs 2 CUDA GPU(s)" in out, out[-3000:]
    r = _pytest(["-rs", "-m", "gpu", *files], {ext.REQUIRE_GPU_ENV: "0"})
    out = r.stdout + r.stderr
    assert r.returncode == 0 and " passed" not in out and "failed" not in out, out[-3000:]


def test_host_device_tests_run_with_a_smaller_preset_count():
    """A preset --xla_force_host_platform_device_count=2 is raised to 8: the
    sharding tests still run (none skip)."""
    r = _pytest(["-rs", "tests/attn_dist/test_sharding.py", "-k", "sharded_causal_matches_oracle"],
                {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    out = r.stdout + r.stderr
    assert r.returncode == 0 and " passed" in out and "skipped" not in out, out[-3000:]
