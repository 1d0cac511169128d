"""No import circle between packrl modules or between packrl folders, and no import of a layer
above the importer's, computed from the source.

Every ``import`` / ``from ... import`` of a packrl name counts, at module level or inside a
function (a lazy import still ties the two modules together) and under ``if TYPE_CHECKING:``
(a type-only import is still a dependency of knowledge: renaming the imported name breaks the
importer). A folder's edges are the union of its modules' edges; the top-level modules
(``packrl.types``, ``packrl.errors``, ...) are folders of their own. The layer order is the one
docs/design.md states ("Layers, bottom to top"), read from that page.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import packrl

ROOT = Path(packrl.__file__).parent


def _module_name(path: Path) -> str:
    parts = ["packrl", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph() -> dict[str, set[str]]:
    """packrl module -> the packrl modules it imports."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path.name == "__init__.py"):
                while name and name not in files and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in files and name != module and name.startswith("packrl"):
                    graph[module].add(name)
    return graph


def _folder(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circle_between_modules():
    assert cycles(import_graph()) == []


def test_no_circle_between_folders():
    folders: dict[str, set[str]] = defaultdict(set)
    for module, imported in import_graph().items():
        for other in imported:
            if _folder(other) != _folder(module) and _folder(module) != "packrl":
                folders[_folder(module)].add(_folder(other))
    assert cycles(folders) == []


def test_the_check_sees_a_circle():
    graph = {"packrl.a.x": {"packrl.b.y"}, "packrl.b.y": {"packrl.a.z"}, "packrl.a.z": set()}
    assert cycles(graph) == []
    folders = {"packrl.a": {"packrl.b"}, "packrl.b": {"packrl.a"}}
    assert cycles(folders) == [["packrl.a", "packrl.b"]]
    assert import_graph()["packrl.trainer.loop"] >= {"packrl.distributed.group", "packrl.config.schema"}


def design_layers() -> dict[str, int]:
    """``packrl.<folder or module>`` -> its layer, bottom 0, from docs/design.md's "Layers, bottom
    to top" sentence (groups separated by ``->``, names in backticks)."""
    text = (ROOT.parent / "docs" / "design.md").read_text()
    sentence = " ".join(text.split("Layers, bottom to top:", 1)[1].split(". ", 1)[0].split())
    return {f"packrl.{name.strip(' `')}": rank for rank, group in enumerate(sentence.split("->"))
            for name in group.split(",")}


def test_no_module_imports_a_layer_above_its_own():
    layers = design_layers()
    assert {"packrl.errors", "packrl.seqlen", "packrl.config", "packrl.cli"} <= set(layers)
    upward = []
    for module, imported in import_graph().items():
        for other in imported:
            source, target = _folder(module), _folder(other)
            if source in layers and target in layers and layers[target] > layers[source]:
                upward.append(f"{module} -> {other}")
    assert upward == [], upward


def test_every_folder_has_a_layer():
    folders = {_folder(module) for module in import_graph()} - {"packrl", "packrl._lazy"}
    assert folders <= set(design_layers()), sorted(folders - set(design_layers()))


def test_the_runtime_never_imports_the_pre_run_tools():
    """inspect/ (audit, preflight, memory estimate) is for before a run: only the CLI imports it."""
    users = {module for module, imported in import_graph().items()
             if any(_folder(other) == "packrl.inspect" for other in imported) and _folder(module) not in ("packrl.inspect", "packrl.cli")}
    assert users == set(), users
