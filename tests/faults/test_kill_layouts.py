"""The kill campaign on the layouts the due rule serves: the cluster shape (memory -> NVMe and memory -> PFS,
fanned out) and NVMe -> bucket (a real S3-protocol server).

A trainer process checkpoints the known state (faultkit) and is SIGKILLed at a point of the flush path
(a frame a flush copies, an object an upload puts, a deletion by retention, the commit's rename) or at a
random moment. Then every committed copy on every tier must hold exactly its step's bytes; ``ls`` must
mark what is still due; a restarted runner must bring every step reported durable to the last tier (the
PFS, the bucket: they keep everything here, so a step missing there was lost), after which ``ls`` shows
nothing pending and ``tierstate flush`` copies nothing. Each trial is tallied (TIERSTATE_FAULT_TALLY).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import s3server

from faultkit import Trial, matches_step, run_trainer, scaled, tally
from tierstate import cli
from tierstate.pipeline.config import PipelineConfig, parse_config
from tierstate.pipeline.runner import Runner
from tierstate.tiers.reading.stored import StoredCheckpoint
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.objstore import ObjectStore
from tierstate.tiers.storage.s3tier import S3Tier

pytestmark = pytest.mark.faults

STEPS = 6
MEMORY = {"kind": "memory", "size": "32MiB", "retention": {"keep_last": 1}}


def _cluster(root: Path) -> dict[str, Any]:
    return {
        "memory": {**MEMORY, "path": str(root / "memory")},
        "nvme": {"path": str(root / "nvme"), "flush": {"every": 1}, "retention": {"keep_last": 2}},
        "pfs": {"path": str(root / "pfs"), "flush": {"every": 1}},  # keeps everything: the audit's reference
    }


def _bucket(root: Path, endpoint: str, bucket: str) -> dict[str, Any]:
    return {
        "nvme": {"path": str(root / "nvme"), "retention": {"keep_last": 1}},
        "bucket": {"kind": "s3", "url": f"s3://{bucket}/kills", "endpoint_url": endpoint, "region": "us-east-1",
                   "flush": {"every": 1, "workers": 1, "retries": 1, "backoff": 0.05}},
    }  # fmt: skip


def _extra(tiers: dict[str, Any]) -> dict[str, Any]:
    """faultkit's trainer overrides: these tiers, persisting to the first (configs/default.yaml names nvme)."""
    return {"tiers": tiers, "pipeline__stages__persist__tier": next(iter(tiers))}


def _config(root: Path, tiers: dict[str, Any]) -> tuple[PipelineConfig, Path]:
    """The layout as the runner and the CLI read it, and its YAML file (for the CLI)."""
    document = {"tiers": tiers, "chunk_size": "1MiB", "host_cache": {"size": "4MiB"}}
    path = root / "layout.yaml"
    path.write_text(json.dumps(document))
    return parse_config(document), path


def _cli_json(*args: str) -> Any:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([*args, "--json"])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())


def _copies(config: PipelineConfig) -> dict[str, dict[int, Any]]:
    """Every committed copy on every tier, bucket included, as the reader sees it: a location per step."""
    dirs = {name: FilesystemTier(name, t.path) for name, t in config.tiers.items()}
    held: dict[str, dict[int, Any]] = {n: {s: t.location(s) for s in t.steps()} for n, t in dirs.items()}
    for name, spec in config.buckets.items():
        tier = S3Tier(name, ObjectStore(name, spec.url, endpoint_url=spec.endpoint_url))
        held[name] = {step: tier.source(step) for step in tier.steps()}
    return held


def _wrong(config: PipelineConfig) -> list[str]:
    """Every committed copy whose bytes are not its step's."""
    wrong = []
    for tier, steps in _copies(config).items():
        for step, where in steps.items():
            try:
                state = StoredCheckpoint(where, step).read()
            except Exception as exc:  # any committed copy that does not read is a loss
                wrong.append(f"{tier} step {step}: {type(exc).__name__}: {exc}")
                continue
            if not matches_step(state, step):
                wrong.append(f"{tier} step {step}: bytes differ from the state of step {step}")
    return wrong


def _campaign(root: Path, tiers: dict[str, Any], last: str, trial: Trial, name: str) -> None:
    assert trial.exitcode == -signal.SIGKILL, f"the trainer was not killed (exit code {trial.exitcode})"
    config, path = _config(root, tiers)
    assert _wrong(config) == []
    held = _copies(config)
    listed = _cli_json("ls", "--config", str(path))
    pending = {(e["tier"], e["step"]) for e in listed if e.get("due_on")}
    for step in trial.durable:  # nowhere yet on the last tier: still on a faster one, marked pending
        if step not in held[last]:
            holders = [tier for tier, steps in held.items() if step in steps]
            assert holders, f"step {step}, reported durable, is on no tier"
            assert any((tier, step) in pending for tier in holders), f"step {step} is not marked pending"
    Runner(config).close()  # a restarted runner resumes what the kill left
    held = _copies(config)
    lost = [step for step in trial.durable if step not in held[last]]
    wrong = _wrong(config)
    tally(name, trials=1, faults=1, losses=len(lost) + len(wrong), checkpoints=len(trial.durable))
    assert lost == [] and wrong == []
    listed = _cli_json("ls", "--config", str(path))
    assert [e for e in listed if e.get("due_on")] == []
    assert _cli_json("flush", "--config", str(path))["flushes"] == []


def _points(hits: dict[str, int], count: int, seed: int) -> list[tuple[str, int]]:
    """``count`` (point, N) pairs cycling over the points, each point's N drawn from 1..hits[point] without
    repeating until all are used, so the kills land in different checkpoints."""
    rng = random.Random(seed)
    draws: dict[str, list[int]] = {point: [] for point in hits}
    trials = []
    for point in (list(hits) * count)[:count]:
        draws[point] = draws[point] or rng.sample(range(1, hits[point] + 1), hits[point])
        trials.append((point, draws[point].pop()))
    return trials


# Per checkpoint: 5 frames copied to each of NVMe and the PFS, one deletion per tier once retention runs.
_CLUSTER_POINTS = {"migrate.frame": 10 * (STEPS - 1), "prune.delete": 2 * (STEPS - 2), "commit.rename": STEPS - 1}


@pytest.mark.parametrize("point,nth", _points(_CLUSTER_POINTS, scaled(6), 35))
def test_kill_on_the_cluster_shape_at_a_flush_point(tmp_path: Path, point: str, nth: int) -> None:
    tiers = _cluster(tmp_path)
    trial = run_trainer(tmp_path, 1, STEPS, fault=f"{point}@{nth}", extra=_extra(tiers))
    _campaign(tmp_path, tiers, "pfs", trial, "kill_cluster")


@pytest.mark.parametrize("seed", range(scaled(3)))
def test_kill_on_the_cluster_shape_at_a_random_moment(tmp_path: Path, seed: int) -> None:
    tiers = _cluster(tmp_path)
    delay = random.Random(3500 + seed).uniform(0.0, 1.0)
    trial = run_trainer(tmp_path, 1, 8, kill_after=delay, extra=_extra(tiers))
    _campaign(tmp_path, tiers, "pfs", trial, "kill_cluster_random")


endpoint = s3server.endpoint  # the S3-protocol server the s3 tests start, and a fresh bucket on it
bucket = s3server.bucket

# Per checkpoint: an index and a data object put, one deletion on NVMe once retention runs.
_BUCKET_POINTS = {"s3.object": 2 * (STEPS - 1), "prune.delete": STEPS - 2, "commit.rename": STEPS - 1}


@pytest.mark.parametrize("point,nth", _points(_BUCKET_POINTS, scaled(4), 36))
def test_kill_on_nvme_to_bucket_at_a_flush_point(
    tmp_path: Path, endpoint: str, bucket: str, point: str, nth: int
) -> None:
    tiers = _bucket(tmp_path, endpoint, bucket)
    trial = run_trainer(tmp_path, 1, STEPS, fault=f"{point}@{nth}", extra=_extra(tiers), env=s3server.CREDENTIALS)
    _campaign(tmp_path, tiers, "bucket", trial, "kill_bucket")


@pytest.mark.parametrize("seed", range(scaled(2)))
def test_kill_on_nvme_to_bucket_at_a_random_moment(tmp_path: Path, endpoint: str, bucket: str, seed: int) -> None:
    tiers = _bucket(tmp_path, endpoint, bucket)
    delay = random.Random(3600 + seed).uniform(0.0, 2.0)
    trial = run_trainer(tmp_path, 1, 8, kill_after=delay, extra=_extra(tiers), env=s3server.CREDENTIALS)
    _campaign(tmp_path, tiers, "bucket", trial, "kill_bucket_random")
