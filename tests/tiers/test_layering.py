"""The modules of ``tiers`` import each other without a cycle, and reading is layered.

Reading a checkpoint is three layers, each importing only layers below it: ``pieces`` (frames ->
verified bytes in byte buffers), ``reshard`` (boxes of sharded tensors across rank files),
``reader`` (whole items, ``load``). The rank file-name grammar has one home, ``names``.
Imports are read from the source with ``ast``, function-level ones included (a cycle hidden in
a function is still a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = REPO / "tiers"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The sibling modules of ``tiers`` that ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierstate.tiers."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("tierstate.tiers.")}
    return found & modules


def import_graph() -> dict[str, set[str]]:
    modules = {path.stem for path in TIERS.glob("*.py")}
    return {path.stem: _imports(path, modules) for path in TIERS.glob("*.py")}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_cycle_finder_finds_a_cycle_hidden_among_others() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycle(graph) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_tiers_modules_import_each_other_without_a_cycle() -> None:
    assert cycle(import_graph()) is None


def test_reading_layers_import_only_downwards() -> None:
    graph = import_graph()
    assert not graph["pieces"] & {"reshard", "reader"}
    assert "pieces" in graph["reshard"] and "reader" not in graph["reshard"]
    assert {"pieces", "reshard"} <= graph["reader"]
    assert not graph["names"]  # the file-name grammar needs nothing: any module may use it
