"""PEP 517 backend: scikit-build-core, with the kernels' build requirements
asked for only when the kernels are built.

The kernels (the ``jax_attn_dist._cuda`` extension) need nanobind, the XLA FFI
headers (from jaxlib alone: jax itself is not needed to build), the CUTLASS/CuTe
headers (nvidia-cutlass) and nvcc >= 12.3 for sm_90a. A machine with a CUDA
toolkit uses it (CUDACXX, -DCMAKE_CUDA_COMPILER in CMAKE_ARGS, CUDA_HOME /
CUDA_PATH, nvcc on PATH, /usr/local/cuda). A machine without one gets NVIDIA's
CUDA 13.0 compiler wheels in the isolated build environment; CMakeLists.txt
finds them there. JAX_ATTN_DIST_NVCC=pip forces the PyPI toolchain, =system
forbids it.

JAX_ATTN_DIST_BUILD_KERNELS=0 (or off/false/no) builds the pure-Python
package: none of those requirements is asked for, CMake does not run, and the
wheel is ``py3-none-any``; jax_attn_dist then serves every call from its jnp
paths. The default (unset, 1, on, true, yes) builds the kernels.
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (re-exported PEP 517 hooks)
    build_sdist,
    get_requires_for_build_sdist,
)

#: What building the kernels needs besides scikit-build-core (and the CMake and
#: Ninja it asks for). The FFI headers come from the OLDEST jaxlib we support:
#: XLA keeps accepting handlers built against older FFI API versions, not
#: newer ones, so one build runs on jax 0.10.2 and on 0.11.x alike.
KERNEL_BUILD_REQUIRES = [
    "nanobind>=2.4",
    "jaxlib==0.10.2",
    "nvidia-cutlass==4.2.0.0",
]

PYPI_CUDA_TOOLCHAIN = [
    "nvidia-cuda-nvcc==13.0.*",
    "nvidia-nvvm==13.0.*",
    "nvidia-cuda-crt==13.0.*",
    "nvidia-cuda-runtime==13.0.*",
    "nvidia-cuda-cccl==13.0.*",
]

BUILD_KERNELS_ENV = "JAX_ATTN_DIST_BUILD_KERNELS"
_TRUE = {"1", "on", "true", "yes"}
_FALSE = {"0", "off", "false", "no"}


def build_kernels() -> bool:
    """Whether this build compiles the kernels (JAX_ATTN_DIST_BUILD_KERNELS)."""
    raw = os.environ.get(BUILD_KERNELS_ENV, "").strip().lower()
    if raw in ("", *_TRUE):
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{BUILD_KERNELS_ENV} must be 1/0, on/off, true/false or yes/no, got {raw!r}")


def system_nvcc() -> str | None:
    """The nvcc that CMake would pick on its own, or None."""
    if os.environ.get("CUDACXX"):
        return os.environ["CUDACXX"]
    for arg in os.environ.get("CMAKE_ARGS", "").split():
        if arg.startswith("-DCMAKE_CUDA_COMPILER="):
            return arg.split("=", 1)[1].split(":")[-1] or None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def _needs_pypi_toolchain() -> bool:
    choice = os.environ.get("JAX_ATTN_DIST_NVCC", "auto").lower()
    if choice not in ("auto", "pip", "system"):
        raise ValueError(f"JAX_ATTN_DIST_NVCC must be auto, pip or system, got {choice!r}")
    if choice == "pip":
        return True
    if choice == "system":
        return False
    return system_nvcc() is None


def _settings(config_settings):
    """The scikit-build-core settings for this build: without the kernels, no
    CMake run and a pure-Python wheel."""
    if build_kernels():
        return config_settings
    settings = dict(config_settings or {})
    settings["wheel.cmake"] = "false"
    settings["wheel.py-api"] = "py3"
    return settings


def _requires(skbuild_requires):
    requires = list(skbuild_requires)
    if build_kernels():
        requires += KERNEL_BUILD_REQUIRES
        if _needs_pypi_toolchain():
            requires += PYPI_CUDA_TOOLCHAIN
    return requires


def get_requires_for_build_wheel(config_settings=None):
    return _requires(_skbuild.get_requires_for_build_wheel(_settings(config_settings)))


def get_requires_for_build_editable(config_settings=None):
    return _requires(_skbuild.get_requires_for_build_editable(_settings(config_settings)))


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _skbuild.prepare_metadata_for_build_wheel(metadata_directory, _settings(config_settings))


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _skbuild.prepare_metadata_for_build_editable(metadata_directory, _settings(config_settings))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild.build_wheel(wheel_directory, _settings(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild.build_editable(wheel_directory, _settings(config_settings), metadata_directory)
