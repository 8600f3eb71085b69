"""tierstate as people install it: a wheel with its configs, license and metadata, used from a
directory that has nothing to do with this checkout; and a facade that loads torch only when used."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import tierstate

REPO = Path(__file__).resolve().parents[1]

# What the README's embedding example leaves to the reader: a model whose output has a .loss, its
# optimizer and scheduler, batches and a step count. The example itself runs as the README has it.
PRELUDE = '''
from types import SimpleNamespace

import torch


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x):
        return SimpleNamespace(loss=self.layer(x).pow(2).mean())


model = TinyModel()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=50)
steps = 200


def batch():
    return torch.randn(4, 8)
'''

EPILOGUE = '''
import os
import tierstate
print("tierstate from", tierstate.__file__)
print("checkpoints", sorted(os.listdir("checkpoints/nvme")), "step", counters["step"])
'''


def _embedding_example() -> str:
    """The first Python block of the README's "Embedding the runner" section, verbatim."""
    section = (REPO / "README.md").read_text().split("## Embedding the runner", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)


PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once for the tests of this module."""
    dist = tmp_path_factory.mktemp("dist")
    # Built in isolation, as pip builds for users: with the setuptools pyproject.toml asks for, not the venv's.
    subprocess.run([*PIP, "wheel", "--quiet", "--no-deps", "-w", str(dist), str(REPO)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    [built] = dist.glob("tierstate-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_runs_the_readme_example_with_the_packaged_default_from_an_unrelated_directory(
    tmp_path: Path, wheel: Path
) -> None:
    """Installed alone (``--target``), the wheel is one import package with its configs, license and metadata,
    and the README's example runs from a directory that has nothing to do with this checkout."""
    site, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    pip = PIP
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"tierstate/configs/{name}.yaml" for name in ("default", "tiered", "compressed", "cluster")} <= set(names)
    assert {"tierstate/py.typed", f"tierstate-{tierstate.__version__}.dist-info/licenses/LICENSE"} <= set(names)
    metadata = zipfile.ZipFile(wheel).read(f"tierstate-{tierstate.__version__}.dist-info/METADATA").decode()
    fields = ("License-Expression: Apache-2.0", "Requires-Dist: torch>=2.5", "Classifier: Typing :: Typed",
              "Classifier: Programming Language :: Python :: 3.11", "Project-URL: Paper, https://",
              'Requires-Dist: h5py>=3.8; extra == "hdf5"', 'Requires-Dist: ruff>=0.5; extra == "lint"')  # fmt: skip
    for field in fields:
        assert field in metadata
    assert "Requires-Dist: h5py>=3.8\n" not in metadata  # an extra: only writing HDF5 needs it
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    top = sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert top == ["tierstate"] and (site / "tierstate" / "py.typed").is_file()  # one import package, typed

    (work / "example.py").write_text(PRELUDE + _embedding_example() + EPILOGUE)
    env = {"PYTHONPATH": str(site), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # no checkout on the path

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout

    probe = "import tierstate, tierstate.cli; print(tierstate.__file__); print(len(tierstate.__all__))"
    assert run("-c", probe).split() == [str(site / "tierstate" / "__init__.py"), str(len(tierstate.__all__))]
    out = run("example.py")
    assert f"tierstate from {site / 'tierstate' / '__init__.py'}" in out
    assert "checkpoints ['step-100', 'step-200'] step 200" in out
    assert (work / "checkpoints" / "nvme" / "step-200" / "manifest.json").is_file()
    listed = run("-m", "tierstate", "ls", "--config", "default").splitlines()
    assert [line.split()[:3] for line in listed[1:]] == [["nvme", "100", "committed"], ["nvme", "200", "committed"]]
    assert run("-m", "tierstate", "--version") == f"tierstate {tierstate.__version__}\n"
    run("-m", "tierstate", "init")
    assert (work / "default.yaml").read_text() == (REPO / "configs" / "default.yaml").read_text()


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_imports_with_the_repository_root_as_working_directory(
    tmp_path: Path, wheel: Path
) -> None:
    """A Python started in the checkout has the checkout's root first on ``sys.path``: no folder there
    may shadow the installed ``tierstate`` (the facade's folder did, and ``tierstate.pipeline`` was missing)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([*PIP, "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    [site] = (venv / "lib").glob("python3*/site-packages")
    # The dependencies (torch, pydantic, ...) as this interpreter has them; a path listed in a .pth file
    # comes after the venv's own site-packages, and its own .pth files (an editable install's) are not run.
    import pydantic
    import torch

    (site / "deps.pth").write_text("".join(f"{Path(m.__file__).parents[1]}\n" for m in (torch, pydantic)))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}  # no PYTHONPATH

    def run(*args: str) -> str:
        done = subprocess.run([str(python), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout

    probe = (
        "import tierstate, tierstate.pipeline.runner, tierstate.cli.commands, tierstate.providers\n"
        "print(tierstate.__file__)\nprint(tierstate.pipeline.runner.__file__)\nprint(tierstate.Runner.__name__)\n"
    )
    facade, runner, name = run("-c", probe).split()
    assert Path(facade) == site / "tierstate" / "__init__.py"
    assert Path(runner) == site / "tierstate" / "pipeline" / "runner.py"
    assert name == "Runner"
    assert run("-m", "tierstate", "--version") == f"tierstate {tierstate.__version__}\n"
    (tmp_path / "nvme").mkdir()
    assert run("-m", "tierstate", "ls", "--tier", f"nvme={tmp_path / 'nvme'}") == "no checkpoints on nvme\n"


@pytest.mark.slow
def test_the_sdist_ships_no_partial_test_suite_and_builds_the_wheel(tmp_path: Path) -> None:
    """The sdist once held tests/test_*.py without their conftest: a suite that could only fail. It holds
    none now (MANIFEST.in), and everything a wheel is built from."""
    tree, tools, dist = tmp_path / "tree", tmp_path / "tools", tmp_path / "dist"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):  # the files a fresh clone has
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_bytes((REPO / name).read_bytes())
    # The setuptools pyproject.toml asks for, as an isolated build has it (not the venv's).
    subprocess.run([*PIP, "install", "--quiet", "--target", str(tools), "setuptools>=77"],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    build = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    done = subprocess.run([sys.executable, "-c", build], cwd=tree, env={**os.environ, "PYTHONPATH": str(tools)},
                          capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    sdist = dist / done.stdout.split()[-1]
    with tarfile.open(sdist) as archive:
        names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
    assert not [name for name in names if name.startswith("tests")]
    assert {"src/tierstate/cli/__init__.py", "pipeline/runner.py", "configs/default.yaml", "LICENSE"} <= set(names)
    subprocess.run([*PIP, "wheel", "--quiet", "--no-deps", "-w", str(dist), str(sdist)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    [wheel] = dist.glob("tierstate-*.whl")
    assert {"tierstate/cli/__init__.py", "tierstate/configs/default.yaml"} <= set(zipfile.ZipFile(wheel).namelist())


def test_the_facade_names_each_public_name_once_for_the_interpreter_and_for_type_checkers() -> None:
    """``_HOMES`` (where ``__getattr__`` imports a name from) and the ``TYPE_CHECKING`` imports (what type
    checkers and editors read) must say the same, and ``__all__`` must list exactly those names."""
    tree = ast.parse((REPO / "src" / "tierstate" / "__init__.py").read_text())
    [block] = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    typed = {(alias.name, node.module) for node in block.body for alias in node.names}
    homes = {(name, module) for module, names in tierstate._HOMES.items() for name in names}
    modules = {(name, module.rpartition(".")[0]) for name, module in tierstate._MODULES.items()}  # public modules
    assert typed == homes | modules
    public = [name for name, _ in homes | modules] + ["TierstateError", "__version__"]
    assert sorted(tierstate.__all__) == sorted(public)
    for name, module in homes:
        assert getattr(tierstate, name) is getattr(sys.modules[module], name)
    for name, module in tierstate._MODULES.items():
        assert getattr(tierstate, name) is sys.modules[module]
    assert "Runner" in dir(tierstate)
    with pytest.raises(AttributeError, match="module 'tierstate' has no attribute 'Runer'"):
        tierstate.Runer  # noqa: B018


def test_importing_tierstate_loads_no_torch_until_a_name_needs_it() -> None:
    probe = (
        "import sys, tierstate\n"
        "before = 'torch' in sys.modules\n"
        "tierstate.Runner\n"
        "print(before, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout == "False True\n"


def test_reading_a_config_loads_no_torch() -> None:
    """A config with a bucket is checked (its url, its endpoint) without the object store, boto3 or torch."""
    probe = (
        "import sys\n"
        "from tierstate import parse_config\n"
        "parse_config({'tiers': {'nvme': {'path': '/tmp/x'}, 'b': {'kind': 's3', 'url': 's3://my-bucket/p', "
        "'endpoint_url': 'http://127.0.0.1:9000', 'flush': {'every': 1}}}})\n"
        "print(sorted(m for m in ('torch', 'boto3') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout == "[]\n"
