"""The modules of ``tiers`` import each other without a cycle, and reading is layered.

Reading a checkpoint is layers, each importing only layers below it: ``source`` (where bytes come
from: a directory, a bucket prefix), ``pieces`` (frames -> verified bytes in byte buffers),
``reshard`` (boxes of sharded tensors across rank files), ``reader`` (whole items), ``livefill``
(stored tensors straight into live ones, beside ``reshard``), and on top
``stored`` (one object per stored checkpoint), the only one read from outside. The rank file-name
grammar has one home, ``names``. Between packages: pipeline may import providers and tiers; neither
imports pipeline; the pipeline, the integrations and the CLI read checkpoints only through ``stored``;
the integrations are built like user code, on the facade (``tierstate``, ``tierstate.errors``) and the
read object (``tierstate.tiers.reading.stored``) alone, and the facade imports no integration.
Imports are read from the source with ``ast``, function-level ones included (a cycle hidden in
a function is still a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = REPO / "tiers"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``tiers`` (``group.module``) that ``path``, in tiers/GROUP/, imports, anywhere in it."""
    group = path.parent.name
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level in (1, 2):
            # from .X / from . import X (this group); from ..G.X / from ..G import X (another group)
            prefix = (group,) if node.level == 1 else tuple((node.module or "").split(".")[:1])
            named = (node.module or "").split(".")[(0 if node.level == 1 else 1) :]
            if named and named[0]:
                found.add(".".join((*prefix, named[0])))
            else:
                found |= {".".join((*prefix, alias.name)) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierstate.tiers."):
            found.add(".".join(node.module.split(".")[2:4]))
        elif isinstance(node, ast.Import):
            found |= {".".join(a.name.split(".")[2:4]) for a in node.names if a.name.startswith("tierstate.tiers.")}
    return found & modules


def _module(path: Path) -> str:
    return f"{path.parent.name}.{path.stem}"


def import_graph() -> dict[str, set[str]]:
    files = [path for path in TIERS.glob("*/*.py") if path.stem != "__init__"]
    modules = {_module(path) for path in files}
    return {_module(path): _imports(path, modules) for path in files}


def test_tiers_is_grouped_by_job() -> None:
    """Every module of tiers lives in one of its sub-packages, each saying what it holds."""
    assert [p.name for p in TIERS.glob("*.py")] == ["__init__.py"]
    groups = {p.parent.name for p in TIERS.glob("*/*.py")}
    assert groups == {"format", "storage", "reading", "ops"}
    assert all((TIERS / group / "__init__.py").read_text().startswith('"""') for group in groups)


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
    r = "reading."
    assert not graph[r + "source"] & {"format.format", r + "pieces", r + "reshard", r + "reader", r + "stored"}
    assert not graph[r + "pieces"] & {r + "reshard", r + "reader", r + "stored"}
    assert r + "pieces" in graph[r + "reshard"] and not graph[r + "reshard"] & {r + "reader", r + "stored"}
    assert {r + "pieces", r + "reshard"} <= graph[r + "reader"] and r + "stored" not in graph[r + "reader"]
    assert {r + "reader", r + "reshard", "format.multirank", r + "source"} <= graph[r + "stored"]
    assert r + "pieces" in graph[r + "livefill"]
    assert not graph[r + "livefill"] & {r + "reshard", r + "reader", r + "stored"}
    assert r + "livefill" in graph[r + "stored"]
    assert not graph["format.names"]  # the file-name grammar needs nothing: any module may use it


PACKAGES = {"pipeline": REPO / "pipeline", "providers": REPO / "providers", "tiers": TIERS}
OUTSIDE = {"integrations": REPO / "src" / "tierstate" / "integrations", "cli": REPO / "src" / "tierstate" / "cli"}
READING_INTERNALS = {"reader", "reshard", "pieces", "source", "livefill"}  # read only through tiers.reading.stored
READING = "tiers.reading"


def _targets(path: Path, package: str) -> set[str]:
    """``package.module`` of every tierstate module ``path`` imports (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # a sibling
                names = [node.module] if node.module else [a.name for a in node.names]
                found |= {f"{package}.{n.split('.')[0]}" for n in names}
            elif node.level >= 2 and node.module:  # ..tiers.reading.stored from pipeline/ or src/tierstate/x/
                found.add(".".join(node.module.split(".")[: 3 if node.module.startswith("tiers.") else 2]))
            elif (node.module or "").startswith("tierstate."):
                parts = node.module.split(".")
                found.add(".".join(parts[1 : 4 if parts[1] == "tiers" else 3]))
        elif isinstance(node, ast.Import):
            for alias in (a for a in node.names if a.name.startswith("tierstate.")):
                parts = alias.name.split(".")
                found.add(".".join(parts[1 : 4 if parts[1] == "tiers" else 3]))
    return found


def _imports_of(directory: Path, package: str) -> dict[str, set[str]]:
    return {f"{package}/{p.name}": _targets(p, package) for p in directory.rglob("*.py")}


def test_nothing_below_the_pipeline_imports_it() -> None:
    for package in ("providers", "tiers"):
        upward = {
            f: {t for t in ts if t.startswith("pipeline")} for f, ts in _imports_of(PACKAGES[package], package).items()
        }
        assert not {f: ts for f, ts in upward.items() if ts}, f"{package} imports pipeline"


def test_the_pipeline_and_the_integrations_read_checkpoints_only_through_the_stored_object() -> None:
    importers = _imports_of(PACKAGES["pipeline"], "pipeline")
    for name, directory in OUTSIDE.items():
        importers |= _imports_of(directory, name)
    reaching = {
        f: sorted(t for t in ts if t.rpartition(".")[0] == READING and t.rpartition(".")[2] in READING_INTERNALS)
        for f, ts in importers.items()
    }
    assert not {f: ts for f, ts in reaching.items() if ts}


def test_the_import_reader_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from ..tiers.reading.reader import x\nfrom tierstate.tiers.reading.pieces import y\nfrom .job import z\n"
    )
    assert _targets(module, "pipeline") == {"tiers.reading.reader", "tiers.reading.pieces", "pipeline.job"}


INTEGRATIONS = OUTSIDE["integrations"]
FACADE_AND_READ_OBJECT = {"tierstate", "tierstate.errors", "tierstate.tiers.reading.stored"}
SRC = REPO / "src" / "tierstate"
#: What ``from tierstate import NAME`` may name besides the facade's attributes: a module or subpackage.
SUBMODULES = {*PACKAGES, *(p.stem for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())}


def _modules_named(path: Path, package: str) -> set[str]:
    """The absolute name of every tierstate module ``path`` (in ``package``, dotted) imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            if module == "tierstate":  # ``from tierstate import tiers`` imports a subpackage, not a facade name
                found |= {f"tierstate.{a.name}" for a in node.names if a.name in SUBMODULES}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name == "tierstate" or name.startswith("tierstate.")}


def _beyond_facade(path: Path) -> set[str]:
    """What an integration module imports from the library other than the facade, the read object and
    its fellow integrations."""
    return {
        name
        for name in _modules_named(path, "tierstate.integrations")
        if name not in FACADE_AND_READ_OBJECT and not name.startswith("tierstate.integrations")
    }


def test_the_integrations_import_only_the_facade_and_the_read_object() -> None:
    reaching = {p.name: sorted(_beyond_facade(p)) for p in INTEGRATIONS.rglob("*.py")}
    assert not {name: modules for name, modules in reaching.items() if modules}


def test_the_facade_imports_no_integration() -> None:
    facade = REPO / "src" / "tierstate" / "__init__.py"
    assert not {m for m in _modules_named(facade, "tierstate") if m.startswith("tierstate.integrations")}


def test_the_facade_check_sees_every_way_past_it(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from tierstate import Runner\nfrom ..tiers.reading.stored import StoredCheckpoint\nfrom .copies import x\n"
        "import torch\nfrom tierstate.errors import TierstateError\n"
        "def f():\n    from ..pipeline.runner import Runner\n    import tierstate.tiers.storage.filesystem\n"
        "from ..providers import layout\nfrom .. import tiers\n"
    )
    assert _beyond_facade(module) == {
        "tierstate.pipeline.runner", "tierstate.tiers.storage.filesystem", "tierstate.providers", "tierstate.tiers"
    }
