"""The compiled CUDA extension, if there is one.

``jax_attn_dist._cuda`` is a nanobind module built by CMake; a source checkout
may lack it, in which case the CUDA path is unavailable and nothing fails at
import. When present, its ``registrations()`` (a dict: FFI target name ->
PyCapsule) are registered with XLA for the CUDA platform, once, on first use.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import threading
from typing import Optional, Tuple

import jax

_lock = threading.Lock()
_state: Optional[Tuple[bool, str]] = None


def _installed_extension():
    """The extension of the installed jax_attn_dist distribution, loaded by path.

    `python -m pytest` / `python -m jax_attn_dist` run from a source checkout put
    the checkout first on sys.path, so `jax_attn_dist` is the source tree, which
    has no compiled `_cuda`; the one `pip install .` built is in site-packages.
    """
    try:
        dist = importlib.metadata.distribution("jax_attn_dist")
    except importlib.metadata.PackageNotFoundError:
        return None
    from jax_attn_dist import __version__

    if dist.version != __version__:  # its FFI contract may differ from this source tree's
        return None
    for f in dist.files or ():
        if f.parent.name == "jax_attn_dist" and f.name.startswith("_cuda.") and f.suffix in (".so", ".pyd"):
            spec = importlib.util.spec_from_file_location("jax_attn_dist._cuda", f.locate())
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def _load() -> Tuple[bool, str]:
    try:
        from jax_attn_dist import _cuda  # type: ignore[attr-defined]
    except ImportError as e:
        _cuda = _installed_extension()
        if _cuda is None:
            return False, f"the CUDA extension jax_attn_dist._cuda is not built/importable ({e})"
    try:
        registrations = dict(_cuda.registrations())
        if not registrations:
            return False, "jax_attn_dist._cuda.registrations() is empty"
        for name, capsule in registrations.items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    except Exception as e:  # registration must never break import or tracing
        return False, f"registering the CUDA FFI targets failed: {type(e).__name__}: {e}"
    return True, "registered: " + ", ".join(sorted(registrations))


def ensure_registered() -> Tuple[bool, str]:
    """Imports the extension and registers its FFI targets (once).
    Returns (available, reason)."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state


def kernel_available() -> bool:
    """True when the compiled CUDA extension imported and its FFI handler is
    registered with XLA for CUDA. (It says nothing about whether a GPU is
    present: see ``jax.default_backend()``.)"""
    return ensure_registered()[0]


def kernel_unavailable_reason() -> str:
    """Why ``kernel_available()`` is False (or what was registered)."""
    return ensure_registered()[1]
