"""Buckets under the one rule for what is due where (tiers/ops/due.py), against a real S3-protocol server.

A bucket is a flush target like a directory: its handle future resolves, its receipt frees the local
copy by retention, ``ls`` and ``tierstate flush`` see what it still has to receive. A bucket that fails
for a while (500, 403, dropped connections) and comes back loses no step: the steps whose upload failed
stay on NVMe, pinned, until a restarted runner or ``tierstate flush`` uploads them. A trainer SIGKILLed
mid-upload leaves its steps pending the same way.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server
from s3server import FaultyProxy

from conftest import REPO
from due_layouts import check_steady, cli_json, document, expected
from tierstate import cli
from tierstate.pipeline.config import parse_config
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.reading.stored import StoredCheckpoint
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.objstore import ObjectStore
from tierstate.tiers.storage.s3tier import S3Tier

endpoint = s3server.endpoint
bucket = s3server.bucket
STEPS = 24  # per runner, even: both runs end on a step the every-2 bucket takes


def _bucket(endpoint: str, url: str, retention: dict[str, Any] | None = None, **flush: Any) -> dict[str, Any]:
    return {
        "kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1",
        "flush": {"every": 1, "retries": 1, "backoff": 0.01, **flush}, "retention": retention or {},
    }  # fmt: skip


def _layout(kind: str, root: Path, endpoint: str, url: str) -> dict[str, Any]:
    nvme = {"path": str(root / "nvme"), "retention": {"keep_last": 1}}
    if kind == "nvme -> bucket":
        return document(None, tiers={"nvme": nvme, "bucket": _bucket(endpoint, url, {"keep_last": 2})})
    pfs = {"path": str(root / "pfs"), "flush": {"every": 1}, "retention": {"keep_last": 2}}
    bucket = _bucket(endpoint, url, {"keep_last": 2}, every=2, **{"from": "pfs"})
    return document(None, tiers={"nvme": nvme, "pfs": pfs, "bucket": bucket})


def _bucket_steps(endpoint: str, url: str) -> list[int]:
    return S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint)).steps()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nvme -> bucket", "nvme -> pfs -> bucket"])
def test_a_layout_with_a_bucket_settles_into_what_retention_keeps(kind, endpoint, bucket, tmp_path, capsys):
    url = f"s3://{bucket}/run"
    layout = _layout(kind, tmp_path, endpoint, url)
    check_steady(layout, tmp_path, capsys, STEPS)
    config = parse_config(layout)
    brought = [s for s in range(1, 2 * STEPS + 1) if config.flush_graph().carries(config.persist_tier, "bucket", s)]
    assert _bucket_steps(endpoint, url) == brought[-2:]
    nvme = FilesystemTier("nvme", tmp_path / "nvme")
    assert nvme.steps() == [2 * STEPS] == expected(config, 2 * STEPS)["nvme"]


def _checkpoints(runner: Runner, steps: range, before: dict[int, Any] | None = None) -> None:
    """Checkpoint ``steps``, each awaited on every tier it is due on; ``before[step]()`` runs before one."""
    state = {"w": torch.zeros(8192)}
    runner.register(model=TensorDictProvider(state))
    for step in steps:
        if before and step in before:
            before[step]()
        state["w"].fill_(step)
        handle = runner.checkpoint(step)
        concurrent.futures.wait(list(handle.tier_futures.values()))


@pytest.mark.parametrize("fault", ["500", "403", "drop"])
def test_a_bucket_that_fails_for_a_while_loses_no_step(fault, endpoint, bucket, tmp_path, capsys):
    url = f"s3://{bucket}/flaky"
    proxy = FaultyProxy(endpoint)
    try:
        layout = document(None, tiers={
            "nvme": {"path": str(tmp_path / "nvme"), "retention": {"keep_last": 1}},
            "bucket": _bucket(proxy.endpoint, url),  # keeps everything: a step missing there was lost
        })  # fmt: skip
        runner = Runner.from_dict(layout)
        down, up = (lambda: setattr(proxy, "failing", fault)), (lambda: setattr(proxy, "failing", None))
        _checkpoints(runner, range(1, 13), before={4: down, 9: up})
        runner.close()
        assert sorted(f.step for f in runner.flush_failures) == [4, 5, 6, 7, 8]
        nvme = FilesystemTier("nvme", tmp_path / "nvme")
        assert nvme.steps() == [4, 5, 6, 7, 8, 12]  # each failed upload's copy kept, the rest let go
        assert _bucket_steps(endpoint, url) == [1, 2, 3, 9, 10, 11, 12]
        config = tmp_path / "layout.yaml"
        config.write_text(json.dumps(layout))
        listed = cli_json(capsys, "ls", "--config", str(config))
        assert {e["step"]: e.get("due_on") for e in listed if e["tier"] == "nvme"} == {
            4: ["bucket"], 5: ["bucket"], 6: ["bucket"], 7: ["bucket"], 8: ["bucket"], 12: None,
        }
        restarted = Runner.from_dict(layout)  # resumes the uploads the failures left
        restarted.close()
        assert restarted.flush_failures == []
        assert _bucket_steps(endpoint, url) == list(range(1, 13))
        assert nvme.steps() == [12]
    finally:
        proxy.close()


# A trainer on the layout in argv[1]: steps 1..4 of a 4 MiB state (an index and one data object each).
_TRAINER = """
import json, sys, torch
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
runner = Runner.from_dict(json.loads(open(sys.argv[1]).read()))
state = {"w": torch.zeros(1 << 20)}
runner.register(model=TensorDictProvider(state))
for step in range(1, 5):
    state["w"].fill_(step)
    runner.checkpoint(step)
    runner.wait_captured()
runner.close()
"""


@pytest.mark.parametrize("how", ["tierstate flush", "a restarted runner"])
def test_steps_a_kill_mid_upload_left_are_pending_and_uploaded(how, endpoint, bucket, tmp_path, capsys):
    url = f"s3://{bucket}/killed"
    layout = document(None, tiers={
        "nvme": {"path": str(tmp_path / "nvme"), "retention": {"keep_last": 1}},
        "bucket": _bucket(endpoint, url, workers=1, bandwidth="16MiB"),
    })  # fmt: skip
    config = tmp_path / "layout.yaml"
    config.write_text(json.dumps(layout))
    env = {**os.environ, "TIERSTATE_FAULT": "s3.object@3"}  # after step 2's index, before its data
    killed = subprocess.run([sys.executable, "-c", _TRAINER, str(config)], cwd=REPO, env=env, timeout=300)
    assert killed.returncode == -9, f"the trainer was not killed mid-upload (exit code {killed.returncode})"
    nvme = FilesystemTier("nvme", tmp_path / "nvme")
    committed = [step for step in nvme.steps() if step > 1]
    assert committed and committed[0] == 2 and _bucket_steps(endpoint, url) == [1]
    listed = cli_json(capsys, "ls", "--config", str(config))
    assert {e["step"]: e.get("due_on") for e in listed if e["tier"] == "nvme"} == {s: ["bucket"] for s in committed}
    if how == "tierstate flush":
        done = cli_json(capsys, "flush", "--config", str(config))
        outcomes = [(f["step"], f["target"], f["error"]) for f in done["flushes"]]
        assert outcomes == [(s, "bucket", None) for s in committed]
    else:
        Runner.from_yaml(config).close()
    held = _bucket_steps(endpoint, url)
    assert held == [1, *committed]
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint))
    for step in held:
        restored = StoredCheckpoint(tier.source(step), step).read()
        assert torch.equal(restored["model/w"], torch.full((1 << 20,), float(step))), step
    assert nvme.steps() == [committed[-1]]


def test_a_step_another_writer_published_as_the_same_checkpoint_counts_as_received(endpoint, bucket, tmp_path, capsys):
    """``tierstate migrate --to bucket`` publishes the step while the runner's own upload of it is under way
    (after its first object): the runner finds its very checkpoint there, reports no failure, and the bucket's
    future, receipt and retention go as for its own upload."""
    url = f"s3://{bucket}/both"
    layout = document(None, tiers={
        "nvme": {"path": str(tmp_path / "nvme"), "retention": {"keep_last": 1}},
        "bucket": _bucket(endpoint, url, workers=1),
    })  # fmt: skip
    config = tmp_path / "layout.yaml"
    config.write_text(json.dumps(layout))
    migrated = []

    def migrate_meanwhile(_path: Path | None) -> None:
        if not migrated:
            migrated.append(True)
            migrated.append(cli.main(["migrate", "1", "--from", "nvme", "--to", "bucket", "--config", str(config)]))

    runner = Runner.from_dict(layout)
    with faults.inject("s3.object", migrate_meanwhile):
        _checkpoints(runner, range(1, 3))
    runner.close()
    assert migrated == [True, 0]
    assert runner.flush_failures == []
    assert _bucket_steps(endpoint, url) == [1, 2]
    assert FilesystemTier("nvme", tmp_path / "nvme").steps() == [2]
