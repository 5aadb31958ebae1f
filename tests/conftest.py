import os

# Eight CPU devices for the sharding tests (tests/test_sharding.py). XLA reads
# this when jax creates its CPU backend, so it must be set before any test
# module imports jax; it does not change the GPU backend.
_HOST_DEVICES = "--xla_force_host_platform_device_count"
if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_HOST_DEVICES}=8").strip()


def pytest_addoption(parser):
    parser.addoption("--run-large", action="store_true", default=False,
                     help="run GPU tests that need several GB of device memory")
