"""The engine's layers, derived from its imports: an import only ever points down (docs/engine.md, "Files").

The units are kvfleet_server's subpackages (attention/, model/, executor/, ...) and its root modules
(config.py, sequence.py, distributed.py, ...). Every import between two units is an edge, module-level
or inside a function alike; only ``if TYPE_CHECKING:`` imports, which never run, are left out. The
layer order is then the topological order of that graph, and a back-edge shows up as a cycle, which
the failure names with the files that make each of its edges. No list of files or layers is kept here.
"""
from __future__ import annotations

import ast
import graphlib
import pathlib

import pytest

import kvfleet_server

PACKAGE = pathlib.Path(kvfleet_server.__file__).parent


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes, skipping the bodies of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            yield from (n for child in node.orelse for n in _imports(ast.Module([child], [])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def import_graph(root: pathlib.Path) -> dict[str, dict[str, set[str]]]:
    """{unit: {unit it imports: {files (relative to root) that import it}}} for the package at ``root``."""
    name = root.name
    units = {p.stem for p in root.iterdir() if p.suffix == ".py" and p.stem != "__init__"} | \
        {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    graph: dict[str, dict[str, set[str]]] = {u: {} for u in units}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] not in units and rel.stem not in units:
            continue  # the package's own __init__ (it re-exports the public API from every layer)
        source = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        package = [name, *rel.parts[:-1]]  # the package the module's relative imports start from
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            for target in targets:
                parts = target.split(".")
                if parts[0] == name and len(parts) > 1 and parts[1] in units and parts[1] != source:
                    graph[source].setdefault(parts[1], set()).add(str(rel))
    return graph


def layer_order(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """The units bottom up. Raises AssertionError naming a cycle's edges and their files."""
    sorter = graphlib.TopologicalSorter({u: set(deps) for u, deps in graph.items()})
    try:
        return list(sorter.static_order())
    except graphlib.CycleError as err:
        cycle = err.args[1]  # [a, b, ..., a]: a imports ..., each one the next's dependency
        edges = [f"{b} -> {a} ({', '.join(sorted(graph[b][a]))})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle, a unit imports one above it: " + "; ".join(edges)) from None


def test_imports_only_point_down():
    graph = import_graph(PACKAGE)
    order = layer_order(graph)
    # the pure, torch-free configuration (the operator imports it) imports no subpackage, even indirectly
    below_config, todo = set(), ["config"]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in below_config:
                below_config.add(dep)
                todo.append(dep)
    assert not {u for u in below_config if (PACKAGE / u).is_dir()}, sorted(below_config)
    assert order.index("sequence") < order.index("engine") and order.index("distributed") < order.index("model")


def test_a_back_edge_fails(tmp_path):
    """Positive control: a lower unit that imports a higher one (even inside a function) is named."""
    pkg = tmp_path / "kvfleet_server"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import x\n")
    (pkg / "low" / "__init__.py").write_text("from ..config import y\n")
    (pkg / "low" / "ops.py").write_text("def f():\n    from ..high.mod import g\n")
    (pkg / "high" / "__init__.py").write_text("")
    (pkg / "high" / "mod.py").write_text("from kvfleet_server.low import ops\n")
    graph = import_graph(pkg)
    assert graph["config"] == {} and graph["low"] == {"config": {"low/__init__.py"}, "high": {"low/ops.py"}}
    with pytest.raises(AssertionError, match=r"low -> high \(low/ops.py\)"):
        layer_order(graph)
    (pkg / "low" / "ops.py").write_text("")
    assert layer_order(import_graph(pkg)) == ["config", "low", "high"]
