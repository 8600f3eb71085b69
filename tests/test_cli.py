"""The ``tierstate`` CLI reads a pipeline YAML exactly as the runner does: what the runner refuses,
the CLI refuses (before touching a checkpoint), and a tier path means the same directory to both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import DEFAULT_YAML
from tierstate.pipeline import cli
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.filesystem import FilesystemTier


def _config(tiers: dict[str, dict]) -> dict:
    """configs/default.yaml with these tiers, small sizes, as a mapping to edit or dump."""
    data = yaml.safe_load(DEFAULT_YAML.read_text())
    data.update(tiers=tiers, chunk_size="1MiB", host_cache={"size": "4MiB"})
    return data


def _write(path: Path, data: dict | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _checkpoints(config: Path, steps: list[int]) -> list[FilesystemTier]:
    """Commit ``steps`` with a runner built from ``config``; the runner's tiers."""
    runner = Runner.from_yaml(config)
    try:
        runner.register(t=TensorDictProvider({"w": torch.arange(1000, dtype=torch.float32)}))
        for step in steps:
            runner.checkpoint(step).result()
    finally:
        runner.close()
    return runner.tiers


def test_retention_written_twice_is_refused_and_nothing_is_deleted(tmp_path, capsys):
    """Plain YAML keeps the last ``retention:``; the runner refuses the file, so prune must too."""
    nvme = tmp_path / "nvme"
    text = yaml.safe_dump(_config({"nvme": {"path": str(nvme)}}), sort_keys=False)
    path = _write(tmp_path / "twice.yaml", text)
    _checkpoints(path, [1, 2, 3, 4])
    twice = text.replace(
        f"    path: {nvme}\n", f"    path: {nvme}\n    retention: {{keep_last: 4}}\n    retention: {{keep_last: 1}}\n"
    )
    assert twice.count("retention:") == 2
    _write(path, twice)
    assert cli.main(["prune", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"tierstate: {path}: line " in err and "invalid YAML: duplicate key 'retention'" in err, err
    assert FilesystemTier("nvme", nvme).steps() == [1, 2, 3, 4]


@pytest.mark.parametrize(("key_path", "message"), [
    ("pipeline.stages.persist.formt", "unknown key; did you mean 'format'?"),
    ("pipeline.stagse", "unknown key; did you mean 'stages'?"),
    ("tiers.nvme.retention.keep_lst", "unknown key; did you mean 'keep_last'?"),
])  # fmt: skip
def test_an_unknown_key_anywhere_is_refused_with_its_key_path(tmp_path, capsys, key_path, message):
    data = _config({"nvme": {"path": str(tmp_path / "nvme"), "retention": {"keep_last": 2}}})
    *parents, leaf = key_path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = "hdf5"
    path = _write(tmp_path / "typo.yaml", data)
    assert cli.main(["ls", "--config", str(path)]) == 2
    assert f"tierstate: {path}: {key_path}: {message}" in capsys.readouterr().err.splitlines()


def test_relative_tier_paths_resolve_as_the_runner_resolves_them(tmp_path, monkeypatch, capsys):
    """Against the working directory (not the YAML's), '..' taken lexically (not through a symlink)."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere" / "deep"
    run.mkdir()
    elsewhere.mkdir(parents=True)
    (run / "link").symlink_to(elsewhere)
    monkeypatch.chdir(run)
    config = _write(tmp_path / "etc" / "pipeline.yaml", _config({"nvme": {"path": "link/../ckpt"}}))
    runner_tiers = _checkpoints(config, [3])
    assert runner_tiers == [FilesystemTier("nvme", run / "ckpt")]
    assert [p.tier for p in cli.load_tiers(str(config), None)] == runner_tiers
    assert [p.tier for p in cli.load_tiers(None, ["nvme=link/../ckpt"])] == runner_tiers
    assert cli.main(["ls", "--json", "--config", str(config)]) == 0
    assert [(e["tier"], e["step"]) for e in json.loads(capsys.readouterr().out)] == [("nvme", 3)]


@pytest.mark.parametrize(("option", "message"), [
    ("nvme", "--tier 'nvme': expected NAME=PATH"),
    ("NVMe=x", "--tier 'NVMe=x': tiers.NVMe: invalid name: string should match pattern '^[a-z][a-z0-9_-]*$'"),
    ("nvme=  ", "--tier 'nvme=  ': tiers.nvme.path: must not be empty"),
])  # fmt: skip
def test_a_bad_tier_option_is_named(tmp_path, capsys, option, message):
    assert cli.main(["ls", "--tier", option]) == 2
    assert f"tierstate: {message}" in capsys.readouterr().err
