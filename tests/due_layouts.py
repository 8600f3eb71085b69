"""Layouts for the due-rule tests (tests/pipeline/test_due_rule.py, tests/tiers/test_s3_due.py): config
documents, a run of checkpoints awaited on every tier they are due on, what each tier should keep, and a
check that a layout settled: each tier holds what its retention keeps, ``ls`` shows nothing pending and
``tierstate flush`` copies nothing."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tierstate import cli
from tierstate.pipeline.config import PipelineConfig, parse_config
from tierstate.pipeline.packaged import packaged_config
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.storage.filesystem import FilesystemTier


def document(base: str | None, **dotted: Any) -> dict[str, Any]:
    """A config document: packaged config ``base`` (or nothing) with ``dotted`` keys set, small chunks."""
    document = yaml.safe_load(packaged_config(base).read_text()) if base else {}
    for key, value in {"chunk_size": "1MiB", "host_cache.size": "4MiB", **dotted}.items():
        node = document
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return document


def run(document: dict[str, Any], first: int, count: int) -> list[str]:
    """``count`` checkpoints from step ``first``, each awaited on every tier it is due on; the tiers'
    names, fastest first. Every flush must succeed."""
    runner = Runner.from_dict(document)
    state = {"w": torch.zeros(4096), "b": torch.zeros(16, dtype=torch.int64)}
    runner.register(model=TensorDictProvider(state))
    try:
        for step in range(first, first + count):
            state["w"].fill_(step)
            state["b"].fill_(step)
            handle = runner.checkpoint(step)
            concurrent.futures.wait(list(handle.tier_futures.values()))
            assert handle.flush_errors == {}, handle.flush_errors
            assert all(handle.persisted(name) for name in handle.tier_futures), handle
    finally:
        runner.close()
    assert runner.flush_failures == []
    return [tier.name for tier in runner.tiers]


def expected(config: PipelineConfig, last: int) -> dict[str, list[int]]:
    """What each directory tier keeps after steps 1..last: the steps the graph brings it, by its retention,
    and the newest step wherever the graph brings it."""
    graph = config.flush_graph()
    steps = list(range(1, last + 1))
    kept = {}
    for name, tier in config.tiers.items():
        brought = [s for s in steps if name == config.persist_tier or graph.carries(config.persist_tier, name, s)]
        kept[name] = [s for s in brought if tier.retention.keeps(s, brought) or s == last]
    return kept


def tier_bytes(config: PipelineConfig) -> dict[str, int]:
    return {name: FilesystemTier(name, t.path).bytes_used() for name, t in config.tiers.items()}


def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    capsys.readouterr()
    code = cli.main([*args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def check_steady(document: dict[str, Any], root: Path, capsys: pytest.CaptureFixture[str], steps: int) -> None:
    """``steps`` checkpoints by a runner, as many by a second one on the same tiers (it goes on over what
    the first left: receipts, pruned steps); then each directory tier holds what its retention keeps, the
    newest step is on every tier the graph reaches, the space they take is what it was after the first
    run, nothing is left partial, ``ls`` shows nothing pending and ``tierstate flush`` copies nothing."""
    config = parse_config(document)
    run(document, 1, steps)
    first = tier_bytes(config)
    run(document, steps + 1, steps)
    held = {name: FilesystemTier(name, t.path).steps() for name, t in config.tiers.items()}
    assert held == expected(config, 2 * steps)
    reached = [config.persist_tier, *config.flush_graph().reached(config.persist_tier, 2 * steps)]
    assert all(2 * steps in held[name] for name in reached if name in held), held
    grown = tier_bytes(config)
    assert grown == first, f"the tiers' space grew from one run to the next: {first} -> {grown}"
    for name, spec in config.tiers.items():
        tier = FilesystemTier(name, spec.path)
        assert tier.partials() == [], f"{name}: leftovers {tier.partials()}"

    path = root / "layout.yaml"
    path.write_text(json.dumps(document))
    listed = cli_json(capsys, "ls", "--config", str(path))
    assert [e for e in listed if e.get("due_on")] == []
    flushed = cli_json(capsys, "flush", "--config", str(path))
    assert flushed["flushes"] == [] and not any(d["delete"] for d in flushed["pruned"])


