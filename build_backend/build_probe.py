"""What CMakeLists.txt asks of the build's Python, in one call per step.

Run by CMake with the build's interpreter (no imports of the backend):

``build_probe.py deps OUT.cmake [--pip-nvcc]``
    Locates the header-only dependencies in the build environment without
    importing them (cutlass_library's __init__ needs cuda-python; jax is not a
    build requirement, only jaxlib, whose package holds the XLA FFI headers),
    and with --pip-nvcc the nvcc of NVIDIA's PyPI CUDA 13.0 wheels. Writes
    CMake ``set()`` lines.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def _cmake_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"jax_attn_dist: the build needs the Python package {name!r}, which is not installed")
    return list(spec.submodule_search_locations)[0]


def _pip_nvcc() -> str:
    spec = importlib.util.find_spec("nvidia")
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "cu13", "bin", "nvcc")
        if os.path.isfile(path):
            return path
    return ""


def deps(out: str, pip_nvcc: bool) -> None:
    values = {
        "JAX_ATTN_DIST_CUTLASS_INCLUDE_DIR": os.path.join(_package_dir("cutlass_library"), "source", "include"),
        "JAX_ATTN_DIST_XLA_FFI_INCLUDE_DIR": os.path.join(_package_dir("jaxlib"), "include"),
        "JAX_ATTN_DIST_NANOBIND_CMAKE_DIR": os.path.join(_package_dir("nanobind"), "cmake"),
    }
    if pip_nvcc:
        values["JAX_ATTN_DIST_PIP_NVCC"] = _pip_nvcc()
    with open(out, "w") as f:
        f.writelines(f"set({k} {_cmake_quote(v)})\n" for k, v in values.items())


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "deps":
        deps(argv[1], "--pip-nvcc" in argv[2:])
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
