"""PEP 517 backend: scikit-build-core, plus a CUDA compiler from PyPI when needed.

The extension needs nvcc >= 12.3 for sm_90a. A machine with a CUDA toolkit uses
it (CUDACXX, -DCMAKE_CUDA_COMPILER in CMAKE_ARGS, CUDA_HOME/CUDA_PATH, nvcc on
PATH, /usr/local/cuda). A machine without one gets NVIDIA's CUDA 13.0 compiler
wheels in the isolated build environment; CMakeLists.txt finds them there.
JAX_ATTN_DIST_NVCC=pip forces the PyPI toolchain, =system forbids it.
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (re-exported PEP 517 hooks)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

PYPI_CUDA_TOOLCHAIN = [
    "nvidia-cuda-nvcc==13.0.*",
    "nvidia-nvvm==13.0.*",
    "nvidia-cuda-crt==13.0.*",
    "nvidia-cuda-runtime==13.0.*",
    "nvidia-cuda-cccl==13.0.*",
]


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


def get_requires_for_build_wheel(config_settings=None):
    requires = list(_skbuild.get_requires_for_build_wheel(config_settings))
    if _needs_pypi_toolchain():
        requires += PYPI_CUDA_TOOLCHAIN
    return requires


def get_requires_for_build_editable(config_settings=None):
    requires = list(_skbuild.get_requires_for_build_editable(config_settings))
    if _needs_pypi_toolchain():
        requires += PYPI_CUDA_TOOLCHAIN
    return requires
