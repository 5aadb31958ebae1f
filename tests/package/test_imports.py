"""The package's import structure: one way (public API -> primitives ->
jnp paths -> contract, over the shared ``_core``), no cycles (function-level
imports included), no cross-module imports of private names, variant lists
that CMake can run alone, and an oracle that shares nothing with jax."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "jax_attn_dist"


def _modules():
    """{dotted name relative to the package ('' for the package itself): ast}."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (ast.parse(path.read_text(), filename=str(path)), path.name == "__init__.py")
    return out


MODULES = _modules()


def _resolve(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name


def _package_imports(name, tree, is_package):
    """(imported module, imported names) for every intra-package import of
    module ``name``, at any depth (function-level imports too)."""
    here = name.split(".") if name else []
    package = here if is_package else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "jax_attn_dist":
                base_parts = []
                node_module = node.module.split(".", 1)[1] if "." in node.module else ""
                target = node_module
            else:
                continue
            if node.level:
                target = ".".join(base_parts + (node.module.split(".") if node.module else []))
            for a in node.names:
                sub = _resolve(target, a.name)
                out.append((sub, []) if sub in MODULES else (target, [a.name]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "jax_attn_dist" and len(parts) > 1:
                    out.append((".".join(parts[1:]), []))
    return out


def _graph():
    graph = {name: set() for name in MODULES}
    for name, (tree, is_package) in MODULES.items():
        for target, _ in _package_imports(name, tree, is_package):
            if target in MODULES and target != name:
                graph[name].add(target)
    return graph


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ re-exports its modules: an edge into a package is
    # an edge into what it imports, so packages are left out of the search.
    packages = {n for n, (_, is_package) in MODULES.items() if is_package}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node] - packages):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(set(graph) - packages):
        if node not in state:
            visit(node, [node])


def test_ops_are_laid_out_alike():
    """Every op package has the same modules, so a new op lands in its own place."""
    ops = sorted(n.split(".")[1] for n, (_, pkg) in MODULES.items() if pkg and n.startswith("ops.") and n.count(".") == 1)
    assert ops, "no op packages found"
    expected = {"api", "autodiff", "backward", "contract", "partitioning", "primitive", "reference", "variants"}
    for op in ops:
        have = {n.split(".")[2] for n in MODULES if n.startswith(f"ops.{op}.")}
        assert expected <= have, f"ops.{op} lacks {sorted(expected - have)}"


def test_imports_run_one_way():
    """Public API -> primitives -> jnp paths -> contract; ``_core`` never
    imports an op; only package __init__ files and the demo import an api."""
    graph = _graph()
    low = {"contract", "reference", "backward", "variants"}
    for name, deps in graph.items():
        is_package = MODULES[name][1]
        if name.startswith("_core"):
            assert not any(d.startswith("ops") for d in deps), f"{name} imports an op: {sorted(deps)}"
        if not is_package and name != "__main__":
            assert not any(_kind(d) == "api" for d in deps), f"{name} imports a public api module"
        if _kind(name) in low or name in ("_core.checks", "_core.chunks", "_core.packing", "_core.ext",
                                           "_core.explicit_axes"):
            high = {d for d in deps if _kind(d) in ("primitive", "autodiff", "api", "batching", "partitioning")
                    or d in ("_core.primitives", "_core.partitioning", "_core.batching")}
            assert not high, f"{name} imports a higher layer: {sorted(high)}"
        if _kind(name) == "contract":
            allowed = {"_core.checks", "_core.chunks", name.rsplit(".", 1)[0] + ".variants"}
            assert deps <= allowed, f"{name} imports {sorted(deps - allowed)}"
    assert graph["_core.checks"] == set()


def test_variant_lists_import_nothing():
    """CMake runs each op's variants.py with a bare Python."""
    for name, (tree, _) in MODULES.items():
        if _kind(name) == "variants":
            imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not imports, f"{name} imports something"


def test_no_cross_module_private_imports():
    """A module's ``_private`` names stay inside it: other modules import
    plain names (the package ``_core`` is the package-internal API)."""
    bad = [(name, target, n) for name, (tree, pkg) in MODULES.items()
           for target, names in _package_imports(name, tree, pkg)
           for n in names if n.startswith("_") and n not in ("__version__", "_core", "_cuda")]
    assert not bad, f"private names imported across modules: {bad}"


def test_oracle_is_independent_of_jax():
    for name, (tree, _) in MODULES.items():
        if name != "oracle" and not name.startswith("oracle."):
            continue
        imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        assert "jax" not in imported and "jax_attn_dist" not in imported, (name, imported)
        relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        assert all(n.level == 1 for n in relative), f"{name} imports from outside the oracle"


def test_version_and_exports():
    """The public names the package declares exist."""
    import jax_attn_dist

    assert isinstance(jax_attn_dist.__version__, str)
    for name in jax_attn_dist.__all__:
        assert hasattr(jax_attn_dist, name)
    assert jax_attn_dist.HEADS_PER_GROUP == 64
