"""The structure drawn from the imports (issue 30): no circle among boost_hf's modules, no arrow up from a lower
layer, and only the model hooks' entry (and the package faces) import ``parallelize``.

The graph is read from the source, not from an import: every ``import`` / ``from ... import`` statement of every
module, those inside functions included (a deferred import does not hide an edge).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "boost_hf"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the boost_hf modules it imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    modules = {module_name(path, package): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import boost_hf.parallel.config.X` -> its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_reader_sees_deferred_imports(tmp_path):
    """The graph reader itself: a circle held by a deferred import is found."""
    package = tmp_path / "boost_hf"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .a import f\n")
    (package / "sub" / "a.py").write_text("def f():\n    from .b import g\n    return g()\n")
    (package / "sub" / "b.py").write_text("from . import a\n\ndef g():\n    return a\n")
    graph = import_graph(package)
    assert graph["boost_hf.sub.a"] == {"boost_hf.sub.b"} and graph["boost_hf.sub.b"] == {"boost_hf.sub.a"}
    assert cycles(graph) == [["boost_hf.sub.a", "boost_hf.sub.b"]]


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_only_the_model_hooks_entry_imports_parallelize():
    graph = import_graph()
    importers = {name for name, edges in graph.items() if "boost_hf.parallel.parallelize" in edges}
    assert importers <= {"boost_hf", "boost_hf.parallel", "boost_hf.checkpoint.model_hooks"}, importers


def test_the_config_is_plain_data():
    """``parallel/config.py`` imports no other boost_hf module; nothing below ``training/`` imports it."""
    graph = import_graph()
    assert graph["boost_hf.parallel.config"] == set()
    lower = [name for name in graph if name.startswith(("boost_hf.parallel", "boost_hf.perf", "boost_hf.modeling", "boost_hf.configuration"))]
    assert {name: sorted(e for e in graph[name] if e.startswith("boost_hf.training")) for name in lower if any(
        e.startswith("boost_hf.training") for e in graph[name])} == {}


def test_the_package_face_is_imported_by_nothing_inside():
    """``boost_hf/__init__.py`` sits on top: no module of the package imports the package itself, so the face's lazy
    ``from . import training`` (``BoostTrainer``) points down, not back up."""
    graph = import_graph()
    assert sorted(name for name, edges in graph.items() if "boost_hf" in edges and name != "boost_hf") == []
