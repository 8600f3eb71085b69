"""Retention and garbage collection: what may be deleted, what never is, and crash-safe deletion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO
from tierstate import cli
from tierstate.providers import TensorDictProvider
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.ops.policy import FlushPolicy, RetentionPolicy
from tierstate.tiers.ops.retention import TierPolicies, collect_garbage, prune
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.locks import reading


@pytest.fixture
def nvme(make_runner, tmp_path) -> FilesystemTier:
    """Committed steps 1..6 (plus 10) on nvme."""
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": torch.arange(1000, dtype=torch.float32)}))
    for step in (1, 2, 3, 4, 5, 6, 10):
        runner.checkpoint(step).result()
    runner.close()
    return FilesystemTier("nvme", tmp_path / "nvme")


def _deleted(decisions) -> list[int]:
    return [d.step for d in decisions if d.delete]


def test_policy_rules():
    steps = [1, 2, 3, 4, 10]
    policy = RetentionPolicy(keep_last=2, keep_every=2)
    assert [policy.keeps(s, steps) for s in steps] == [None, "keep_every=2", None, "keep_last=2", "keep_last=2"]
    assert RetentionPolicy().keeps(1, steps) == "no retention policy" and not RetentionPolicy().active
    assert FlushPolicy(every=5).due(10) and not FlushPolicy(every=5).due(11)


def test_keep_last_and_keep_every_on_one_tier(nvme):
    decisions = prune([TierPolicies(nvme, RetentionPolicy(keep_last=2, keep_every=3))])
    assert _deleted(decisions) == [1, 2, 4, 5]
    assert nvme.steps() == [3, 6, 10]
    assert {d.step: d.reason for d in decisions}[3] == "keep_every=3"


def test_dry_run_deletes_nothing_and_the_newest_is_always_kept(nvme):
    decisions = prune([TierPolicies(nvme, RetentionPolicy(keep_every=4))], dry_run=True)
    assert _deleted(decisions) == [1, 2, 3, 5, 6]  # 10 is no multiple of 4, but it is the newest
    assert {d.step: d.reason for d in decisions}[10] == "the newest checkpoint"
    assert nvme.steps() == [1, 2, 3, 4, 5, 6, 10]


def test_a_checkpoint_being_read_is_not_deleted(nvme):
    with reading(nvme.step_dir(2)):  # as restore, migrate, verify and export hold it
        decisions = prune([TierPolicies(nvme, RetentionPolicy(keep_last=1))])
    assert {d.step: d.reason for d in decisions}[2] == "in use (being read, flushed or restored)"
    assert nvme.steps() == [2, 10]


def test_the_last_copy_of_a_step_due_elsewhere_waits_for_its_flush(nvme, tmp_path):
    pfs = FilesystemTier("pfs", tmp_path / "pfs")
    tiers = [TierPolicies(nvme, RetentionPolicy(keep_last=1)), TierPolicies(pfs, flush=FlushPolicy(every=2))]
    decisions = prune(tiers)
    assert _deleted(decisions) == [1, 3, 5]  # odd steps: no tier is due to hold them
    assert {d.step: d.reason for d in decisions}[4] == "last copy: due on pfs and not flushed there yet"
    migrate(4, nvme, pfs)
    assert _deleted(prune(tiers)) == [4]
    assert nvme.steps() == [2, 6, 10] and pfs.steps() == [4]


def test_deletion_killed_after_unpublishing_leaves_no_checkpoint_and_gc_cleans_up(nvme, tmp_path, capsys):
    """SIGKILL right after the rename: the step is gone from listings and restore; gc removes the rest."""
    tiers = ["--tier", f"nvme={nvme.root}"]
    command = [sys.executable, "-m", "tierstate", "prune", "--keep-last", "6", *tiers]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "TIERSTATE_FAULT": "prune.delete"}, capture_output=True)
    assert done.returncode == -9
    assert nvme.steps() == [2, 3, 4, 5, 6, 10] and (nvme.root / "step-1.deleting").is_dir()
    assert cli.main(["ls", "--json", *tiers]) == 0
    assert [e["state"] for e in json.loads(capsys.readouterr().out) if e["step"] == "step-1.deleting"] == ["deleting"]
    (nvme.root / "step-7.partial").mkdir()  # a young partial: someone may still be writing it
    assert cli.main(["gc", "--json", *tiers]) == 0
    removed = {(e["path"].rsplit("/", 1)[1], e["removed"]) for e in json.loads(capsys.readouterr().out)}
    assert removed == {("step-1.deleting", True), ("step-7.partial", False)}


def test_gc_removes_old_partials_but_not_one_in_use(tmp_path):
    tier = FilesystemTier("pfs", tmp_path / "pfs")
    old, busy = tier.partial_dir(3), tier.partial_dir(4)
    for path in (old, busy):
        path.mkdir(parents=True)
        (path / "rank-00000.data").write_bytes(b"x" * 100)
        hour_ago = time.time() - 3600
        for entry in (path / "rank-00000.data", path):
            os.utime(entry, (hour_ago, hour_ago))
    assert [f.removed for f in collect_garbage([tier], older_than=7200)] == [False, False]
    with reading(busy):  # a migration into it holds a lock
        found = collect_garbage([tier], older_than=60)
    assert [(f.path.name, f.removed, f.reason) for f in found] == [
        ("step-3.partial", True, "removed"), ("step-4.partial", False, "in use")]  # fmt: skip
    assert not old.exists() and busy.exists()
