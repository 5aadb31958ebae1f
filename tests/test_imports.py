"""The package's import structure: one way (public API -> primitives ->
contract), no cycles (function-level imports included), no cross-module
imports of private names, and an oracle that shares nothing with jax."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_attn_dist"


def _modules():
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def _package_imports(name, tree):
    """(imported module, imported names) for every intra-package import of
    module ``name``, at any depth (function-level imports too)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:  # from .x import a, b
                    out.append((node.module.split(".")[0], [a.name for a in node.names]))
                else:  # from . import x, y
                    out.extend((a.name, []) for a in node.names)
            elif node.module and node.module.split(".")[0] == "jax_attn_dist":
                parts = node.module.split(".")
                if len(parts) > 1:
                    out.append((parts[1], [a.name for a in node.names]))
                else:
                    out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "jax_attn_dist" and len(parts) > 1:
                    out.append((parts[1], []))
    return out


def _graph():
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, tree in modules.items():
        for target, _ in _package_imports(name, tree):
            if target in modules and target != name and name != "__init__":
                graph[name].add(target)
    return graph


def test_no_import_cycles():
    graph = _graph()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_imports_run_one_way():
    """The layers: the public API imports the primitives and their rules;
    the primitives import the jnp paths and the contract; nothing below the
    API imports it, and the contract imports nothing of the package."""
    graph = _graph()
    assert {"primitive", "indexer_primitive", "autodiff", "batching", "sharding"} <= graph["api"]
    for name, deps in graph.items():
        if name not in ("__main__",):
            assert "api" not in deps or name == "__main__", f"{name} imports the public API module"
    assert graph["_contract"] == set()
    assert graph["oracle"] == set()
    for low in ("_contract", "_chunks", "reference", "backward", "sharding", "explicit_axes", "_ext"):
        assert not graph[low] & {"primitive", "indexer_primitive", "autodiff", "batching", "api"}, low


def test_no_cross_module_private_imports():
    """A module's ``_private`` names stay inside it: other modules import
    plain names (module names like ``_contract`` are the package-internal API)."""
    modules = _modules()
    bad = [(name, target, n) for name, tree in modules.items() for target, names in _package_imports(name, tree)
           for n in names if n.startswith("_") and n not in ("__version__",)]
    assert not bad, f"private names imported across modules: {bad}"


def test_oracle_is_independent_of_jax():
    tree = _modules()["oracle"]
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert "jax" not in imported and not any(n.level for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)), imported
