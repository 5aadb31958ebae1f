"""Test configuration: the helpers' folder, host CPU devices for the sharding
tests, the rule by which device-dependent tests run, skip or fail, and how
many pytest-xdist workers ``-n auto`` starts.

* The tests live in one folder per op (``attn_dist/``, ``indexer/``; a new
  op adds its own), one for SPEC §6 (``packing/``, shared by the ops) and
  one for the package as a whole (``package/``). Their shared helpers are
  modules in ``support/``, put on ``sys.path`` here: pytest imports the test
  files with ``--import-mode=importlib`` (pyproject.toml), so test files in
  different folders may share a name and no folder is added to ``sys.path``.
* Eight (or more) host CPU devices, always: XLA reads
  ``--xla_force_host_platform_device_count`` when jax creates its CPU backend,
  so it is set here, before any test module imports jax. A smaller preset
  value is raised to 8 (it would otherwise make the sharding tests vanish).
  Tests marked ``host_devices(n)`` fail, with a message, if fewer exist.
* GPU tests are marked ``gpu`` (or ``gpu(n)`` for n GPUs). They need n
  Hopper (compute capability 9.x, sm_90) GPUs visible to jax and the
  compiled kernel registered. Otherwise they skip
  -- unless ``JAX_ATTN_DIST_REQUIRE_GPU=N`` with N >= n is set
  (``tools/gpu_check.sh`` sets it): then they fail and say why.
"""

import os
import re
import sys

import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

NEEDED_HOST_DEVICES = 8
_HOST_DEVICES = "--xla_force_host_platform_device_count"


def _with_host_devices(flags: str, count: int) -> str:
    m = re.search(rf"{_HOST_DEVICES}=(\d+)", flags)
    if m is None:
        return f"{flags} {_HOST_DEVICES}={count}".strip()
    if int(m.group(1)) < count:
        return flags.replace(m.group(0), f"{_HOST_DEVICES}={count}")
    return flags


os.environ["XLA_FLAGS"] = _with_host_devices(os.environ.get("XLA_FLAGS", ""), NEEDED_HOST_DEVICES)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _may_use_a_gpu() -> bool:
    """Whether jax in this process could pick a CUDA GPU, decided without
    starting a backend (which would take GPU memory in the controller)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return any(p in platforms for p in ("cuda", "gpu", "rocm"))
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject.toml's addopts): one worker per CPU for the CPU
    suite, none (the tests run in this process, one after another) where the
    GPU tests may run: each worker would open the same GPU and take its own
    share of its memory, and a test required to pass must not depend on how
    its neighbours load the device."""
    try:
        required = int(os.environ.get("JAX_ATTN_DIST_REQUIRE_GPU", "").strip() or 0)
    except ValueError:
        required = 1  # reported by the gpu marker's check
    if required > 0 or _may_use_a_gpu():
        return 0
    return _cpus()


def pytest_addoption(parser):
    parser.addoption("--run-large", action="store_true", default=False,
                     help="run GPU tests that need several GB of device memory")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(n=1): needs n sm_90 (Hopper) GPUs and the compiled kernel "
                                       "(skips, or fails under JAX_ATTN_DIST_REQUIRE_GPU >= n)")
    config.addinivalue_line("markers", "host_devices(n): needs n host CPU devices (fails otherwise)")


@pytest.fixture
def cross_lowering(monkeypatch):
    """Lower for CUDA as a CPU-only process does (e.g. to export): pretend
    there is no local CUDA backend, so that a GPU machine without the built
    extension behaves like this one."""
    from jax_attn_dist._core import primitives

    monkeypatch.setattr(primitives, "local_cuda_backend", lambda: False)


@pytest.fixture
def fake_kernel_available(monkeypatch):
    """Pretend the extension registered, so that lowering with
    ``implementation="cuda"`` needs no built extension (no CUDA handler is
    ever run by a test that uses this)."""
    from jax_attn_dist._core import ext

    monkeypatch.setattr(ext, "_state", ext._State(True, "registered: (fake for tests)"))


def gpu_unavailable_reason(n: int, required: bool):
    """None when n Hopper (sm_90) GPUs are visible and the kernel is registered, else why
    not. ``required``: an extension problem (registration error, stale build)
    is a reason too, not only a warning."""
    import jax

    from jax_attn_dist._core import ext

    gpus = ext.hopper_gpus()  # the sm_90a kernels run on compute capability 9.x only
    if len(gpus) < n:
        try:
            cuda = len(jax.devices("cuda"))
        except RuntimeError:
            cuda = 0
        if cuda < n:  # (tests/package/test_ext.py reads this wording on a machine without a GPU)
            seen = f"needs {n} CUDA GPU(s) visible to jax, found {cuda}"
        else:
            seen = f"{cuda} CUDA GPU(s) visible to jax, {len(gpus)} of compute capability 9.x"
        return f"needs {n} sm_90 GPU(s), found {len(gpus)} ({seen}; default backend {jax.default_backend()!r})"
    try:
        if not ext.extension_registered(required=required):
            return f"the CUDA kernel is not available: {ext.kernel_unavailable_reason()}"
    except RuntimeError as e:  # a registration error or a stale build, raised because the kernel is required
        return str(e)
    return None


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpu")
    if marker is not None:
        from jax_attn_dist._core import ext

        n = marker.args[0] if marker.args else 1
        required = ext.required_gpus()
        why = gpu_unavailable_reason(n, required >= n)
        if why is not None:
            if required >= n:
                pytest.fail(f"{ext.REQUIRE_GPU_ENV}={required}, but {why}", pytrace=False)
            pytest.skip(why)
    marker = item.get_closest_marker("host_devices")
    if marker is not None:
        import jax

        n = marker.args[0]
        try:
            found = len(jax.devices("cpu"))
        except RuntimeError as e:
            pytest.fail(f"needs {n} host CPU devices, but the CPU backend is unavailable: {e}", pytrace=False)
        if found < n:
            pytest.fail(f"needs {n} host CPU devices, found {found} (conftest.py sets {_HOST_DEVICES}="
                        f"{NEEDED_HOST_DEVICES}; was jax initialised before it ran?)", pytrace=False)
