"""What CMakeLists.txt asks of the build's Python, in one call per step.

Run by CMake with the build's interpreter (no imports of the backend):

``build_probe.py deps OUT.cmake [--pip-nvcc]``
    Locates the header-only dependencies in the build environment without
    importing them (cutlass_library's __init__ needs cuda-python; jax is not a
    build requirement, only jaxlib, whose package holds the XLA FFI headers),
    and with --pip-nvcc the nvcc of NVIDIA's PyPI CUDA 13.0 wheels. Writes
    CMake ``set()`` lines.

``build_probe.py fingerprint OUT.txt --nvcc NVCC --cxx CXX [--file PATH]...``
    Writes what identifies the toolchain and dependencies, for the kernel
    build cache's key (see CMakeLists.txt): the versions of the header
    packages, the XLA FFI headers' contents, the Python extension suffix, and
    the contents of the compilers' executables (nvcc and what it runs: cicc,
    ptxas, cudafe++, fatbinary, its host compiler; the C++ compiler) and of
    each --file. Executables are hashed once per (path, size, mtime): the
    memo is kept next to OUT.txt.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig


def _cmake_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"jax_attn_dist: the build needs the Python package {name!r}, which is not installed")
    return list(spec.submodule_search_locations)[0]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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


class _Hasher:
    """Content hashes of files, memoised by (path, size, mtime) in a JSON file."""

    def __init__(self, memo_path: str):
        self.memo_path = memo_path
        try:
            with open(memo_path) as f:
                self.memo = json.load(f)
        except (OSError, ValueError):
            self.memo = {}
        self.used = {}

    def __call__(self, path: str) -> str:
        path = os.path.realpath(path)
        try:
            st = os.stat(path)
        except OSError:
            return "missing"
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        entry = self.memo.get(path)
        if entry is None or entry[0] != stamp:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            entry = [stamp, h.hexdigest()]
        self.used[path] = entry
        return entry[1]

    def save(self) -> None:
        tmp = f"{self.memo_path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.used, f)
        os.replace(tmp, self.memo_path)


def _run(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"<{' '.join(cmd)} failed: {e}>"
    return (r.stdout + r.stderr).strip()


def _compiler(name: str, hasher: _Hasher, lines: list[str], label: str) -> None:
    """A host compiler: its --version, driver binary and, for GCC, cc1plus."""
    exe = shutil.which(name) or name
    lines.append(f"{label} {os.path.realpath(exe)} {hasher(exe)}")
    lines.append(f"{label}_version {(_run([exe, '--version']).splitlines() or [''])[0]}")
    proper = _run([exe, "-print-prog-name=cc1plus"])
    if os.path.isabs(proper) and os.path.isfile(proper):
        lines.append(f"{label}_cc1plus {hasher(proper)}")


def fingerprint(out: str, nvcc: str, cxx: str, files: list[str]) -> None:
    hasher = _Hasher(os.path.join(os.path.dirname(os.path.abspath(out)), "build_probe_memo.json"))
    lines = [
        f"python {sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')} {sys.version}",
        f"nanobind {_version('nanobind')}",
        f"nvidia-cutlass {_version('nvidia-cutlass')}",
        f"jaxlib {_version('jaxlib')}",
    ]
    ffi_dir = os.path.join(_package_dir("jaxlib"), "include", "xla", "ffi", "api")
    for name in sorted(os.listdir(ffi_dir)):
        lines.append(f"xla_ffi/{name} {hasher(os.path.join(ffi_dir, name))}")
    # The PyPI CUDA wheels, when the toolchain comes from them.
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"] or ""
        if name.lower().startswith("nvidia-") and name.lower() != "nvidia-cutlass":
            lines.append(f"{name} {dist.version}")

    # nvcc and the programs it runs, as its dry run names them.
    lines.append(f"nvcc {hasher(nvcc)} {' '.join(_run([nvcc, '--version']).splitlines()[-2:])}")
    dry = _run([nvcc, "-dryrun", "-arch=sm_90a", "-c", "-x", "cu", os.devnull, "-o", os.devnull])
    env = dict(re.findall(r"^#\$ (\w+)=(.*)$", dry, re.M))
    top = env.get("TOP", os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    cicc = os.path.join(env.get("CICC_PATH", os.path.join(top, "nvvm", "bin")), "cicc")
    for tool in (os.path.join(top, "bin", "nvcc"), cicc, os.path.join(top, "bin", "ptxas"), os.path.join(top, "bin", "cudafe++"),
                 os.path.join(top, "bin", "fatbinary")):
        lines.append(f"{os.path.basename(tool)}_bin {hasher(tool)}")
    hosts = sorted({m for m in re.findall(r'^#\$ "?([^\s"]+)"? .*-E -x c\+\+', dry, re.M)})
    for i, host in enumerate(hosts):
        _compiler(host, hasher, lines, f"nvcc_host{i}")
    _compiler(cxx, hasher, lines, "cxx")
    for path in files:
        lines.append(f"file {os.path.basename(path)} {hasher(path)}")

    hasher.save()
    with open(out, "w") as f:
        f.write("".join(line + "\n" for line in lines))


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "deps":
        deps(argv[1], "--pip-nvcc" in argv[2:])
        return
    if len(argv) >= 2 and argv[0] == "fingerprint":
        opts = {"--nvcc": [], "--cxx": [], "--file": []}
        rest = argv[2:]
        for flag, value in zip(rest[::2], rest[1::2]):
            opts[flag].append(value)
        fingerprint(argv[1], opts["--nvcc"][0], opts["--cxx"][0], opts["--file"])
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
