"""The README cannot drift: its YAML validates as written, its Python compiles (and the quick start runs,
with stand-ins for the model and data it leaves to the reader), its CLI lines parse, and its console
samples show the columns the commands print."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tierstate import Runner
from tierstate.cli import main
from tierstate.cli.parser import build_parser
from tierstate.pipeline.config import parse_config
from tierstate.pipeline.packaged import packaged_config

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _blocks(language: str) -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(2)) for m in BLOCK.finditer(text) if m.group(1) == language]


def _ids(blocks: list[tuple[int, str]]) -> list[str]:
    return [f"README.md:{line}" for line, _ in blocks]


def _default_config() -> dict[str, Any]:
    return yaml.safe_load(packaged_config("default").read_text())


@pytest.mark.parametrize(("line", "block"), _blocks("yaml"), ids=_ids(_blocks("yaml")))
def test_every_yaml_block_validates_as_written(line: int, block: str) -> None:
    """A block with tiers is a whole config; one with only a ``pipeline`` section is that section of the
    packaged default (as the README introduces it)."""
    document = yaml.safe_load(block)
    if "tiers" not in document:
        document = {**_default_config(), **document}
    parse_config(document)  # raises ConfigError naming the key path


@pytest.mark.parametrize(("line", "block"), _blocks("python"), ids=_ids(_blocks("python")))
def test_every_python_block_compiles(line: int, block: str) -> None:
    compile(block, f"README.md:{line}", "exec")


class _Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _StandIn(torch.nn.Module):
    """The model the quick start leaves to the reader: returns an object with ``.loss``, as HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(self.layer(x).pow(2).mean())


def test_the_quick_start_runs_with_stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [(line, block)] = [(line, b) for line, b in _blocks("python") if "runner = Runner.from_yaml()" in b][:1]
    monkeypatch.chdir(tmp_path)
    model = _StandIn()
    opt = torch.optim.AdamW(model.parameters())
    names: dict[str, Any] = {
        "model": model, "opt": opt, "scheduler": torch.optim.lr_scheduler.StepLR(opt, 50), "steps": 200,
        "batch": lambda: torch.randn(4, 8),
    }  # fmt: skip
    exec(compile(block, f"README.md:{line}", "exec"), names)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "nvme").iterdir()) == ["step-100", "step-200"]
    assert names["counters"] == {"step": 200}


def _cli_lines() -> list[tuple[int, list[str]]]:
    lines = []
    for line, block in _blocks("console"):
        for offset, text in enumerate(block.splitlines()):
            if not text.startswith("$ "):
                continue
            words = shlex.split(text[2:], comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # an environment variable set for it
                words = words[1:]
            if words and words[0] == "tierstate":
                lines.append((line + 1 + offset, words[1:]))
    return lines


@pytest.mark.parametrize(("line", "argv"), _cli_lines(), ids=[f"README.md:{n}" for n, _ in _cli_lines()])
def test_every_cli_line_parses(line: int, argv: list[str]) -> None:
    build_parser().parse_args(argv)  # an unknown command or option exits (SystemExit), failing the test


def test_every_config_a_cli_line_names_is_a_packaged_one_or_a_path_it_writes() -> None:
    """For wheel users: ``--config tiered``, not a path into a checkout."""
    for line, argv in _cli_lines():
        if "--config" in argv:
            name = argv[argv.index("--config") + 1]
            assert packaged_config(name).is_file(), f"README.md:{line}: --config {name}"


def test_the_stats_sample_shows_the_columns_tierstate_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    [sample] = [block for _, block in _blocks("console") if block.startswith("$ tierstate stats")]
    header = next(text for text in sample.splitlines() if text.strip().startswith("stage "))
    monkeypatch.chdir(tmp_path)
    with Runner.from_dict({"tiers": {"nvme": {"path": "checkpoints/nvme"}}}) as runner:
        runner.register(model=torch.nn.Linear(4, 4))
        runner.checkpoint(3).result()
    capsys.readouterr()
    assert main(["stats", "checkpoints/nvme/step-3"]) == 0
    printed = next(text for text in capsys.readouterr().out.splitlines() if text.strip().startswith("stage "))
    assert header.split() == printed.split()
