"""The compiled CUDA extension, if there is one.

``jax_attn_dist._cuda`` is a nanobind module built by CMake. When present, its
``registrations()`` (a dict: FFI target name -> PyCapsule) are registered with
XLA for the CUDA platform, once, on first use.

Three things can stand between a user and the kernel, and each is reported:

* **No extension** (a source checkout that was never built, or a build
  without it): the CUDA path is unavailable; nothing warns, since the jnp
  path serves every call. ``kernel_unavailable_reason()`` says why.
* **A stale extension**: the extension records a *build identity*, a hash of
  ``csrc/`` and ``CMakeLists.txt`` taken at build time. When the package runs
  from a source checkout, the same hash of the checkout must match, or the
  binary is not the one this source would build (an edit to ``csrc/`` without
  a rebuild): a warning, once -- or an error when the kernel is required.
* **A registration error** (the extension imports but its FFI targets do not
  register, or it fails to import): a warning, once, and the XLA path -- or
  an error when the kernel is required.

The kernels can run only where the extension is registered *and* jax sees a
CUDA GPU of compute capability 9.0 (Hopper): :func:`kernel_status` reports
both.

The kernel is *required* when a call asks for ``implementation="cuda"`` or
when the environment variable ``JAX_ATTN_DIST_REQUIRE_GPU`` is set to a
number >= 1 (the GPU test suite and ``tools/gpu_check.sh`` set it; its value
is the number of GPUs the GPU tests need, see ``tests/conftest.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import threading
import warnings
from pathlib import Path
from typing import Optional


#: Set to N >= 1: the GPU tests fail (not skip) unless N CUDA GPUs and the
#: kernel are usable, and extension errors raise instead of warning.
REQUIRE_GPU_ENV = "JAX_ATTN_DIST_REQUIRE_GPU"

_lock = threading.Lock()
_state: Optional["_State"] = None

#: The FFI targets the ops of this package know (each op declares its own,
#: test-only ones included, when its primitive module is imported).
_declared_targets: set = set()


def declare_ffi_targets(*names: str) -> None:
    """An op's FFI target names: an extension that registers others was
    built from other sources (a stale build)."""
    _declared_targets.update(names)


def required_gpus() -> int:
    """The value of ``JAX_ATTN_DIST_REQUIRE_GPU`` (0 when unset or empty)."""
    raw = os.environ.get(REQUIRE_GPU_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{REQUIRE_GPU_ENV} must be an integer number of GPUs (0, 1, 2, ...), got {raw!r}") from None
    return max(value, 0)


# ----------------------------------------------------------------------------
# build identity
# ----------------------------------------------------------------------------


def build_id_of(root) -> str:
    """The build identity of the sources under ``root``: the SHA-256 of the
    lines ``"<relative path> <sha256 of the file>\\n"`` for every file under
    ``csrc/``, for ``CMakeLists.txt`` and for each op's kernel variant list
    (``jax_attn_dist/ops/*/variants.py``), in sorted path order.
    CMakeLists.txt computes the same string at configure time and compiles it
    into the extension (``_cuda.build_id()``)."""
    root = Path(root)
    paths = ["CMakeLists.txt"]
    paths += [p.relative_to(root).as_posix() for p in (root / "jax_attn_dist" / "ops").glob("*/variants.py")]
    for dirpath, _, files in os.walk(root / "csrc"):
        for name in files:
            paths.append((Path(dirpath) / name).relative_to(root).as_posix())
    text = "".join(f"{p} {hashlib.sha256((root / p).read_bytes()).hexdigest()}\n" for p in sorted(paths))
    return hashlib.sha256(text.encode()).hexdigest()


def source_checkout() -> Optional[Path]:
    """The checkout this package runs from, or None for an installed package."""
    root = Path(__file__).resolve().parents[2]  # jax_attn_dist/_core/ext.py -> the checkout
    return root if (root / "CMakeLists.txt").is_file() and (root / "csrc").is_dir() else None


# ----------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------


class _State:
    def __init__(self, available: bool, reason: str, problem: Optional[str] = None, module=None):
        self.available = available  # the kernel can be called
        self.module = module        # the extension module, when one imported
        self.warned = False
        self.reason = reason        # what was registered, or why not
        self.problem = problem      # an error or a stale build: warned about, or raised when required


def _installed_extension():
    """The extension of the installed jax_attn_dist distribution, loaded by path.

    `python -m pytest` / `python -m jax_attn_dist` run from a source checkout put
    the checkout first on sys.path, so `jax_attn_dist` is the source tree, which
    has no compiled `_cuda`; the one `pip install .` built is in site-packages.
    Its build identity is then checked against the checkout (see _load).
    """
    try:
        dist = importlib.metadata.distribution("jax_attn_dist")
    except importlib.metadata.PackageNotFoundError:
        return None
    from .. import __version__

    if dist.version != __version__:  # its FFI contract may differ from this source tree's
        return None
    for f in dist.files or ():
        if f.parent.name == "jax_attn_dist" and f.name.startswith("_cuda.") and f.suffix in (".so", ".pyd"):
            spec = importlib.util.spec_from_file_location("jax_attn_dist._cuda", f.locate())
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def _import_extension():
    """(module or None, why not). An extension file that exists but fails to
    import is a problem, not an absence."""
    try:
        from .. import _cuda  # type: ignore[attr-defined]

        return _cuda, None
    except ImportError as e:
        missing = f"the CUDA extension jax_attn_dist._cuda is not built/importable ({e})"
        try:
            module = _installed_extension()
        except Exception as e2:  # noqa: BLE001 - a broken binary must be reported, not crash the import
            return None, f"the installed CUDA extension failed to load: {type(e2).__name__}: {e2}"
        return module, (None if module is not None else missing)


def _load() -> _State:
    import jax

    _cuda, why = _import_extension()
    if _cuda is None:
        broken = why.startswith("the installed CUDA extension failed")
        return _State(False, why, problem=why if broken else None)

    stale = None
    checkout = source_checkout()
    built = getattr(_cuda, "build_id", lambda: "unknown")()
    if checkout is not None:
        here = build_id_of(checkout)
        if built != here:
            stale = (
                f"the loaded CUDA extension ({getattr(_cuda, '__file__', '?')}) was built from other sources "
                f"than this checkout ({checkout}): build id {built[:12]} vs the checkout's {here[:12]}. Rebuild it "
                "(pip install .) so that the kernel under test is the one in csrc/"
            )
    try:
        registrations = dict(_cuda.registrations())
        if not registrations:
            return _State(False, "jax_attn_dist._cuda.registrations() is empty", problem="no FFI targets registered",
                          module=_cuda)
        for name, capsule in registrations.items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    except Exception as e:  # noqa: BLE001 - reported below: raised when required, else warned once
        msg = f"registering the CUDA FFI targets failed: {type(e).__name__}: {e}"
        return _State(False, msg, problem=msg, module=_cuda)
    reason = "registered: " + ", ".join(sorted(registrations))
    unknown = sorted(set(registrations) - _declared_targets)
    if unknown and stale is None:
        stale = f"the CUDA extension registers FFI targets this package does not know: {unknown}"
    return _State(True, reason + (f" (stale: {stale})" if stale else ""), problem=stale, module=_cuda)


def ensure_registered(required: bool = False):
    """Imports the extension and registers its FFI targets (once). Returns
    (available, reason). A problem (registration error, failed import, stale
    build) raises RuntimeError when ``required`` or under
    ``JAX_ATTN_DIST_REQUIRE_GPU``, and is warned about once otherwise."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    if _state.problem:
        if required or required_gpus():
            raise RuntimeError(f"jax_attn_dist: the CUDA kernel is required but: {_state.problem}")
        if not _state.warned:
            _state.warned = True
            warnings.warn(f"jax_attn_dist: {_state.problem}", RuntimeWarning, stacklevel=3)
    return _state.available, _state.reason


def extension_registered(required: bool = False) -> bool:
    """True when the compiled CUDA extension imported and its FFI handlers are
    registered with XLA for CUDA. (It says nothing about whether a GPU is
    present: see :func:`kernel_status`.)"""
    return ensure_registered(required)[0]


def hopper_gpus() -> list:
    """The CUDA devices jax sees whose compute capability is 9.x (the sm_90a
    kernels run there and nowhere else); [] without a CUDA backend."""
    import jax

    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return []
    return [d for d in devices if str(getattr(d, "compute_capability", "")).startswith("9.")]


def kernel_status():
    """``(extension, gpus, detail)``: whether the extension is built and
    registered, the Hopper GPUs jax sees, and a one-line description."""
    registered = extension_registered()
    gpus = hopper_gpus()
    ext_text = "extension built and registered" if registered else f"no extension ({kernel_unavailable_reason()})"
    if gpus:
        gpu_text = f"{len(gpus)} Hopper GPU(s) visible ({gpus[0].device_kind})"
    else:
        gpu_text = "no Hopper (sm_90) GPU visible to jax"
    return registered, gpus, f"{ext_text}; {gpu_text}"


def kernel_unavailable_reason() -> str:
    """Why ``kernel_available()`` is False (or what was registered)."""
    if _state is None:
        ensure_registered()
    return _state.reason


def extension_module():
    """The loaded extension module (None if there is none): for its
    ``build_id()`` and the tests."""
    if _state is None:
        try:
            ensure_registered()
        except RuntimeError:
            pass
    return _state.module
