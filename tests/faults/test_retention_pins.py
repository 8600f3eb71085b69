"""Retention lets go of flushed copies; a flush that fails is retried, and what it pins is reported.

A copy a flush tier received and later let go (its own retention pruned it) is no longer due there,
so the NVMe copy goes too: with the README's shape (PFS ``flush: {every: 10}``, ``retention:
{keep_every: 50}``; NVMe ``retention: {keep_last: 2}``) NVMe ends with its last two checkpoints,
not with every flushed step the PFS pruned. A flush failing with a transient error is retried with
backoff; one that keeps failing is reported with the copy it leaves pinned, which retention keeps
until the tier has received it.
"""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from faultkit import DEFAULT_YAML
from tierstate import cli
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.storage import faults

pytestmark = pytest.mark.faults


def _runner(root: Path, flush: dict[str, object], pfs_keep: dict[str, int], nvme_keep: dict[str, int]) -> Runner:
    tiers = {
        "nvme": {"path": str(root / "nvme"), "retention": nvme_keep},
        "pfs": {"path": str(root / "pfs"), "flush": flush, "retention": pfs_keep},
    }
    return Runner.from_yaml(DEFAULT_YAML, {"tiers": tiers, "chunk_size": "1MiB", "host_cache.size": "4MiB"})


def _train(runner: Runner, steps: range) -> None:
    """A checkpoint of a small state at every step, each durable before the next."""
    state = {"w": torch.zeros(4096)}
    runner.register(t=TensorDictProvider(state))
    for step in steps:
        state["w"].fill_(step)
        runner.checkpoint(step).result()


def _prune_dry_run(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[int, str]:
    """What ``tierstate prune --dry-run`` (with the run's policies) says of each NVMe step."""
    config = yaml.safe_load(DEFAULT_YAML.read_text())
    config["tiers"] = {
        "nvme": {"path": str(root / "nvme"), "retention": {"keep_last": 2}},
        "pfs": {"path": str(root / "pfs"), "flush": {"every": 10}, "retention": {"keep_every": 50}},
    }
    path = root / "tiers.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert cli.main(["prune", "--dry-run", "--json", "--only", "nvme", "--config", str(path)]) == 0
    return {d["step"]: d["reason"] for d in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize(("every", "steps"), [(10, 300), (1, 60)])
def test_flushed_copies_the_flush_tier_let_go_are_not_pinned(tmp_path: Path, every: int, steps: int) -> None:
    """Without receipts, 300 steps left 25 checkpoints on NVMe (10, 30, 40, 60, ..., 290)."""
    runner = _runner(tmp_path, {"every": every}, {"keep_every": 50}, {"keep_last": 2})
    _train(runner, range(1, steps + 1))
    runner.close()
    assert runner.flush_failures == []
    assert runner.steps() == {"nvme": [steps - 1, steps], "pfs": sorted({*range(50, steps + 1, 50), steps})}


def test_a_transient_flush_failure_is_retried_with_backoff(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    failed: list[Path | None] = []

    def fail_once(path: Path | None) -> None:
        if not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))

    runner = _runner(tmp_path, {"every": 1, "retries": 2, "backoff": 0.01}, {}, {"keep_last": 1})
    with caplog.at_level(logging.WARNING, "tierstate"), faults.inject("migrate.frame", fail_once):
        _train(runner, range(1, 4))
        runner.close()
    assert failed and runner.flush_failures == []
    assert runner.steps() == {"nvme": [3], "pfs": [1, 2, 3]}
    assert "retry 1 of 2 in 0.01 s" in caplog.text


def test_a_flush_that_keeps_failing_pins_its_copy_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 20's flush fails with EIO on every attempt (when committing on the PFS, after its frames
    were copied): its NVMe copy stays while 10 and 30 go."""
    partial = tmp_path / "pfs" / "step-20.partial"

    def fail_step_20(path: Path | None) -> None:
        if path == partial:
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))

    runner = _runner(tmp_path, {"every": 10, "retries": 2, "backoff": 0.01}, {"keep_every": 50}, {"keep_last": 2})
    with caplog.at_level(logging.WARNING, "tierstate"), faults.inject("commit.manifest", fail_step_20):
        _train(runner, range(1, 41))
        runner.close()
    [failure] = runner.flush_failures
    assert (failure.step, failure.tier, failure.attempts) == (20, "pfs", 3)
    assert "after 3 attempts" in str(failure) and "its copy on nvme stays pinned" in str(failure)
    assert "tierstate migrate 20 --from nvme --to pfs" in caplog.text
    assert runner.steps() == {"nvme": [20, 39, 40], "pfs": [40]}
    assert _prune_dry_run(tmp_path, capsys)[20] == "last copy: due on pfs and not flushed there yet"
    # The copy the message names, made by hand: the PFS receives and prunes it, and NVMe lets go.
    assert cli.main(["migrate", "20", "--from", "nvme", "--to", "pfs", "--tier", f"nvme={tmp_path / 'nvme'}",
                     "--tier", f"pfs={tmp_path / 'pfs'}"]) == 0  # fmt: skip
    assert _prune_dry_run(tmp_path, capsys)[20] == "not kept by keep_last=2"
