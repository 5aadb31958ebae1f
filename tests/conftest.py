"""Test configuration: host CPU devices for the sharding tests, and the rule
by which device-dependent tests run, skip or fail.

* Eight (or more) host CPU devices, always: XLA reads
  ``--xla_force_host_platform_device_count`` when jax creates its CPU backend,
  so it is set here, before any test module imports jax. A smaller preset
  value is raised to 8 (it would otherwise make the sharding tests vanish).
  Tests marked ``host_devices(n)`` fail, with a message, if fewer exist.
* GPU tests are marked ``gpu`` (or ``gpu(n)`` for n GPUs). They need n CUDA
  GPUs visible to jax and the compiled kernel registered. Otherwise they skip
  -- unless ``JAX_ATTN_DIST_REQUIRE_GPU=N`` with N >= n is set
  (``tools/gpu_check.sh`` sets it): then they fail and say why.
"""

import os
import re

import pytest

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


def pytest_addoption(parser):
    parser.addoption("--run-large", action="store_true", default=False,
                     help="run GPU tests that need several GB of device memory")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(n=1): needs n CUDA GPUs and the compiled kernel "
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
    """None when n CUDA GPUs are visible and the kernel is registered, else why
    not. ``required``: an extension problem (registration error, stale build)
    is a reason too, not only a warning."""
    import jax

    from jax_attn_dist._core import ext

    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        gpus = []
    if len(gpus) < n:
        return (f"needs {n} CUDA GPU(s) visible to jax, found {len(gpus)} "
                f"(default backend {jax.default_backend()!r})")
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
