"""The installed shape: one import package, a public facade, one error base."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import tierstate
from tierstate import TierstateError

REPO = Path(__file__).resolve().parents[1]

PUBLIC = {
    "Runner", "load_config", "PipelineConfig", "CheckpointHandle", "CheckpointResult", "RestoreResult",
    "ModuleProvider", "OptimizerProvider", "RNGProvider", "ObjectProvider", "StatefulProvider",
    "CompositeProvider", "TensorDictProvider", "TensorItem", "ObjectItem", "ShardInfo", "load",
    "read_manifest", "TierstateError", "__version__",
}


def test_facade_exports_the_public_api() -> None:
    assert PUBLIC <= set(tierstate.__all__)
    for name in tierstate.__all__:
        assert getattr(tierstate, name) is not None, name
    assert tierstate.__version__.count(".") >= 2


def test_every_error_tierstate_defines_derives_from_the_base() -> None:
    import tierstate.pipeline
    import tierstate.providers
    import tierstate.tiers
    errors = [
        obj for module in list(sys.modules.values())
        if module is not None and getattr(module, "__name__", "").startswith("tierstate.")
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__.startswith("tierstate.")
        and not obj.__name__.startswith("_")
    ]
    assert len(errors) >= 15
    assert [e.__qualname__ for e in errors if not issubclass(e, TierstateError)] == []
    for name in ("ConfigError", "CheckpointFailed", "NoCheckpointError", "TierError", "ManifestError", "RestoreError"):
        assert name in tierstate.__all__, name


def test_errors_keep_their_builtin_bases() -> None:
    assert issubclass(tierstate.TierError, OSError)
    assert issubclass(tierstate.ConfigError, ValueError)
    assert issubclass(tierstate.NoCheckpointError, FileNotFoundError)


def test_python_dash_m_tierstate_runs_the_cli(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tierstate", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "migrate" in proc.stdout


def _library_modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name, from the source tree."""
    roots = {"tierstate": REPO / "src" / "tierstate", "tierstate.pipeline": REPO / "pipeline",
             "tierstate.providers": REPO / "providers", "tierstate.tiers": REPO / "tiers"}  # fmt: skip
    modules = {}
    for package, root in roots.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if package == "tierstate" and parts[0] in ("pipeline", "providers", "tiers"):
                continue  # pyright's links to the three folders, when they are there
            modules[".".join((package, *parts)).removesuffix(".__init__")] = path
    return modules


def _imported(name: str, path: Path) -> set[str]:
    """The tierstate modules ``path`` (module ``name``) imports, anywhere in it, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {module for module in found if module.startswith("tierstate")}


def test_the_cli_alone_prints_and_nothing_below_it_imports_it() -> None:
    """All of the library's output is the CLI's (src/tierstate/cli/); the commands it runs return data.
    Only the entry points import the CLI, so no package reaches upward into it."""
    modules = _library_modules()
    assert "tierstate.cli.run" in modules and "tierstate.pipeline.runner" in modules
    printing = sorted(
        name for name, path in modules.items() if not name.startswith("tierstate.cli")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    )  # fmt: skip
    assert printing == []
    imports = {name: _imported(name, path) for name, path in modules.items()}
    into_cli = sorted(name for name, found in imports.items() if not name.startswith("tierstate.cli")
                      and any(m == "tierstate.cli" or m.startswith("tierstate.cli.") for m in found))  # fmt: skip
    assert into_cli == ["tierstate.__main__"]
    layers = ("tierstate.pipeline", "tierstate.tiers", "tierstate.providers")
    upward = sorted(name for name, found in imports.items() if name.startswith(layers) and "tierstate" in found)
    assert upward == []  # nothing the facade exports takes a name (__version__ once did) from the facade


def test_the_example_imports_only_public_names() -> None:
    """examples/train_gpt.py is what a user copies: it imports tierstate's public names, never its internals."""
    imported = [
        (node.module, alias.name)
        for path in (REPO / "examples").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierstate")
        for alias in node.names
    ]  # fmt: skip
    assert imported and {module for module, _ in imported} == {"tierstate"}
    assert {name for _, name in imported} <= set(tierstate.__all__)


def test_the_runner_explains_itself_in_help() -> None:
    doc = inspect.getdoc(tierstate.Runner) or ""
    for said in ("Runner.from_yaml()", "register(", "restore(\"latest\")", "checkpoint(step)", "close()",
                 "NothingToRestoreError", "RunnerClosedError", "TierInUseError"):  # fmt: skip
        assert said in doc, said


def test_the_metadata_says_where_the_source_and_the_issues_are() -> None:
    import tomllib

    urls = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Source"].startswith("https://") and urls["Issues"].startswith(urls["Source"])
