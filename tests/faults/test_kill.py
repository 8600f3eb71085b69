"""Kill at any point: a trainer SIGKILLed while checkpointing never leaves a lost or false checkpoint.

Each trial runs a real trainer process that checkpoints a state known at every step and dies by
SIGKILL, either at an exact point of the protocol (``TIERSTATE_FAULT=POINT@N``: capture, a frame
write, the data fsync, the manifest, the rename) or at a random moment. Afterwards every committed
checkpoint must hold exactly its step's bytes, every step reported durable must be there, partials
must never be listed or restored, ``restore("latest")`` must return the newest committed step, and a
new run must carry on over the leftovers. SIGKILL keeps the page cache, so this proves the protocol
against process death; against power loss it rests on the fsync order of the commit.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import signal
from pathlib import Path

import pytest

import faultkit
from faultkit import (
    Audit,
    Trial,
    audit,
    matches_step,
    run_trainer,
    scaled,
    state_matches,
    tally,
    trainer,
)
from tierstate import cli
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.ops.retention import collect_garbage, leftovers
from tierstate.tiers.reading.stored import StoredCheckpoint

pytestmark = pytest.mark.faults

STEPS = 6  # checkpoints a trainer attempts per trial
WRITE_POINTS = ("begin", "capture", "persist.write", "persist.fsync", "commit.manifest", "commit.rename")
ONCE_PER_CHECKPOINT = ("begin", "persist.fsync", "commit.manifest", "commit.rename")
HITS_PER_CHECKPOINT = {"capture": 4, "persist.write": 5}  # 4 tensor chunks + 1 object frame


def _spread(hits: dict[str, int], count: int, seed: int) -> list[tuple[str, int]]:
    """``count`` (point, N) pairs cycling over the points; each point's N runs through 1..hits[point]
    in a shuffled order (repeating only once all are used), so kills land in varied checkpoints."""
    rng = random.Random(seed)
    orders: dict[str, list[int]] = {point: [] for point in hits}
    trials = []
    for i in range(count):
        point = list(hits)[i % len(hits)]
        if not orders[point]:
            orders[point] = rng.sample(range(1, hits[point] + 1), hits[point])
        trials.append((point, orders[point].pop()))
    return trials


def _point_trials(count: int) -> list[tuple[str, int]]:
    """Kills at the points of the write path, in any of the first STEPS - 1 checkpoints."""
    return _spread({p: HITS_PER_CHECKPOINT.get(p, 1) * (STEPS - 1) for p in WRITE_POINTS}, count, 20240605)


def _check_after_kill(root: Path, trial: Trial, every_durable_kept: bool = True) -> Audit:
    """The guarantees that hold after any kill; returns the audit for trial-specific checks.

    ``every_durable_kept``: without retention, every step reported durable must still be there.
    """
    assert trial.exitcode == -signal.SIGKILL, f"the trainer was not killed (exit code {trial.exitcode})"
    found = audit(root)
    assert found.losses == []
    if every_durable_kept:
        assert set(trial.durable) <= set(found.steps), "a step reported durable is missing"
    assert not found.steps or max(found.steps) <= max(trial.requested, default=0) + 1
    listed = json.loads(_cli_ls(root))
    committed = {e["step"] for e in listed if e["state"] in ("committed", "verified")}
    assert committed == set(found.steps)
    leftover = [e for e in listed if isinstance(e["step"], str)]
    assert all(e["state"] in ("partial", "deleting") for e in leftover), "a leftover is listed as a checkpoint"
    assert all(e["state"] != "invalid" for e in listed)
    return found


def _cli_ls(root: Path) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["ls", "--json", *(f"--tier={t.name}={t.root}" for t in faultkit.tiers_of(root))]) == 0
    return out.getvalue()


def _resume(root: Path, found: Audit, upto: int) -> int:
    """A new run restores the newest committed step bit-exactly and checkpoints on over the leftovers;
    then garbage collection removes every leftover and touches no checkpoint."""
    start = max(found.steps, default=0) + 1
    with trainer(root) as (runner, state):
        if found.steps:
            assert runner.restore("latest").step == max(found.steps)
            assert state_matches(state, max(found.steps))
        for step in range(start, upto + 1):
            state.advance(step)
            assert runner.checkpoint(step).result().step == step
    after = audit(root)
    assert after.losses == [] and after.steps[-1:] == [upto]
    tiers = faultkit.tiers_of(root)
    collect_garbage(tiers, older_than=0)
    assert [p for tier in tiers for p in leftovers(tier)] == []
    assert audit(root) == after
    return upto - start + 1


@pytest.mark.parametrize("point,nth", _point_trials(scaled(18)))
def test_kill_at_a_protocol_point(tmp_path: Path, point: str, nth: int) -> None:
    trial = run_trainer(tmp_path, 1, STEPS, fault=f"{point}@{nth}")
    found = _check_after_kill(tmp_path, trial)
    if point in ONCE_PER_CHECKPOINT:
        # The N-th hit is in checkpoint N: committed exactly when the rename had happened.
        newest = nth if point == "commit.rename" else nth - 1
        assert found.steps[-1:] == ([newest] if newest else [])
        assert found.partials == ([] if point == "commit.rename" else [f"step-{nth}.partial"])
    resumed = _resume(tmp_path, found, STEPS + 1)
    tally("kill_point", trials=1, faults=1, losses=0, checkpoints=len(trial.durable) + resumed)


@pytest.mark.parametrize("seed", range(scaled(6)))
def test_kill_at_a_random_moment(tmp_path: Path, seed: int) -> None:
    # 3.8 MiB at 48 MiB/s: ~80 ms a checkpoint, so 0-450 ms lands anywhere in the first six.
    delay = random.Random(seed).uniform(0.0, 0.45)
    trial = run_trainer(tmp_path, 1, 8, kill_after=delay)
    found = _check_after_kill(tmp_path, trial)
    resumed = _resume(tmp_path, found, 10)
    tally("kill_random", trials=1, faults=1, losses=0, checkpoints=len(trial.durable) + resumed)


def test_an_unkilled_trainer_commits_every_step(tmp_path: Path) -> None:
    """The control for the trials above: the same trainer without a fault commits all it requested."""
    trial = run_trainer(tmp_path, 1, STEPS)
    assert trial.exitcode == 0 and trial.durable == trial.requested == list(range(1, STEPS + 1))
    found = audit(tmp_path)
    assert found.steps == trial.durable and found.partials == [] and found.losses == []
    assert matches_step(StoredCheckpoint(faultkit.tiers_of(tmp_path)[0].step_dir(STEPS)).read(), STEPS)


# --- background flush (NVMe -> PFS) and retention ---------------------------------------------------

# pfs receives every second step; nvme keeps the newest two, plus any step not yet flushed to pfs.
FLUSHING = {"tiers__nvme__retention": {"keep_last": 2}, "tiers__pfs__flush": {"every": 2}}
FLUSH_STEPS = 8


def _flush_trials(count: int) -> list[tuple[str, int]]:
    """Kills while a flush copies a frame (5 per checkpoint, 4 flushed) or retention deletes a step."""
    return _spread({"migrate.frame": 5 * (FLUSH_STEPS // 2 - 1), "prune.delete": 4}, count, 20240606)


def _check_flush_invariants(root: Path, trial: Trial) -> Audit:
    """After a kill with flush and retention running: nothing lost, nothing half-deleted listed,
    the newest step kept, and every step due on pfs still on pfs or, until flushed there, on nvme."""
    found = _check_after_kill(root, trial, every_durable_kept=False)
    nvme, pfs = faultkit.tiers_of(root)
    if trial.durable:
        assert max(trial.durable) in nvme.steps(), "retention deleted the newest checkpoint"
    for step in trial.durable:
        if step % 2 == 0:
            assert step in pfs.steps() or step in nvme.steps(), f"step {step}, due on pfs, is on neither tier"
    return found


def _finish_flushes(root: Path) -> int:
    """What `tierstate migrate` does after a crash: copy on the steps pfs is due and lacks (resuming)."""
    nvme, pfs = faultkit.tiers_of(root)
    pending = [s for s in nvme.steps() if s % 2 == 0 and s not in pfs.steps()]
    for step in pending:
        migrate(step, nvme, pfs)
    return len(pending)


@pytest.mark.parametrize("point,nth", _flush_trials(scaled(8)))
def test_kill_during_flush_or_retention(tmp_path: Path, point: str, nth: int) -> None:
    trial = run_trainer(tmp_path, 1, FLUSH_STEPS, fault=f"{point}@{nth}", extra=FLUSHING)
    found = _check_flush_invariants(tmp_path, trial)
    left = {p.name for tier in faultkit.tiers_of(tmp_path) for p in leftovers(tier)}
    suffix = ".deleting" if point == "prune.delete" else ".partial"
    assert any(name.endswith(suffix) for name in left), f"killed at {point} but no {suffix} leftover: {left}"
    _finish_flushes(tmp_path)
    _resume(tmp_path, found, FLUSH_STEPS + 1)
    tally("kill_flush", trials=1, faults=1, losses=0, checkpoints=len(trial.durable))


@pytest.mark.parametrize("seed", range(scaled(4)))
def test_kill_at_a_random_moment_with_flush_and_retention(tmp_path: Path, seed: int) -> None:
    delay = random.Random(1000 + seed).uniform(0.0, 0.6)
    trial = run_trainer(tmp_path, 1, FLUSH_STEPS, kill_after=delay, extra=FLUSHING)
    found = _check_flush_invariants(tmp_path, trial)
    _finish_flushes(tmp_path)
    _resume(tmp_path, found, FLUSH_STEPS + 1)
    tally("kill_flush_random", trials=1, faults=1, losses=0, checkpoints=len(trial.durable))
