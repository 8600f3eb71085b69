"""Hostile neighbours on one tier: a second job pointed at the same directory, a garbage collector
run in a loop beside a live trainer, symlinks planted in the tier. None may make a checkpoint
reported durable false, or reach outside the tier.

Both use real trainer processes (forked from faultkit's server) on real directories. The second
job must be refused with an error naming the first job's host and pid; garbage collection must
leave a live writer's partial alone, never fail itself, and every step the trainer reported
durable must afterwards read back bit-exact.
"""

from __future__ import annotations

import errno
import multiprocessing.connection
import socket
from pathlib import Path

import pytest

from faultkit import StepState, audit, make_runner, tally, tiers_of, train, trainer, trainer_context, write_steps
from tierstate.pipeline.runner import Runner
from tierstate.tiers.ops.retention import Leftover, collect_garbage
from tierstate.tiers.storage.filesystem import TierError
from tierstate.tiers.storage.locks import WRITER_LOCK_NAME

pytestmark = pytest.mark.faults

SHARED_STEPS = range(2, 8)  # both jobs checkpoint these at the same time: sharing partials is what broke
GC_ROUNDS = 200_000  # bound on the collector's loop, far beyond the trainer's life; it stops with the trainer
TRAINER_STEPS = 16
BANDWIDTH = "48MiB"  # 3.8 MiB per checkpoint: ~80 ms each, so the two jobs' writes overlap


def _checkpoint(runner: Runner, state: StepState, step: int) -> tuple[int, str | None, str]:
    """Checkpoint ``step`` and wait for it: ``(step, error type or None, error message)``."""
    state.advance(step)
    handle = runner.checkpoint(step)
    runner.wait_captured()
    handle.wait()
    error = handle.error
    return step, type(error).__name__ if error else None, str(error or "")


def first_job(root: str, conn: multiprocessing.connection.Connection) -> None:
    """Checkpoints step 1, then (told "go") the shared steps; closes only when told to stop."""
    runner = make_runner(Path(root), pipeline__stages__persist__bandwidth=BANDWIDTH)
    state = StepState()
    state.register(runner)
    conn.send(_checkpoint(runner, state, 1))
    conn.recv()  # "go": the second job is starting
    for step in SHARED_STEPS:
        conn.send(_checkpoint(runner, state, step))
    conn.recv()  # "stop": the second job has finished; until then this one holds the tier
    runner.close()


def second_job(root: str, conn: multiprocessing.connection.Connection) -> None:
    """Another job on the same tier: tries the shared steps, sends what became of each, trains on."""
    runner = make_runner(Path(root), pipeline__stages__persist__bandwidth=BANDWIDTH)
    state = StepState()
    state.register(runner)
    for step in SHARED_STEPS:
        conn.send(_checkpoint(runner, state, step))
    runner.close()


def _received(conn: multiprocessing.connection.Connection) -> list[tuple[int, str | None, str]]:
    """Everything sent on ``conn`` until its sender closed it."""
    found = []
    while True:
        try:
            found.append(conn.recv())
        except EOFError:
            return found


def test_a_second_job_on_the_same_tier_is_refused_naming_the_first(tmp_path: Path) -> None:
    ctx = trainer_context()
    first_end, theirs = ctx.Pipe()
    first = ctx.Process(target=first_job, args=(str(tmp_path), theirs))
    first.start()
    theirs.close()
    outcomes = [first_end.recv()]  # step 1 is durable: the first job holds the tier
    second_end, theirs = ctx.Pipe(duplex=False)
    second = ctx.Process(target=second_job, args=(str(tmp_path), theirs))
    second.start()
    theirs.close()
    first_end.send("go")
    refusals = _received(second_end)
    second.join()
    outcomes += [first_end.recv() for _ in SHARED_STEPS]
    first_end.send("stop")
    first.join()
    assert first.exitcode == 0 and second.exitcode == 0, "a job died instead of reporting"

    reported = [step for step, error, _ in outcomes + refusals if error is None]
    found = audit(tmp_path)
    assert found.losses == [] and found.partials == []
    assert set(reported) <= set(found.steps), "a step reported durable is missing"
    assert [step for step, error, _ in outcomes if error is None] == [1, *SHARED_STEPS], f"first job: {outcomes}"
    holder = f"host {socket.gethostname()}, pid {first.pid}"
    assert [step for step, _, _ in refusals] == list(SHARED_STEPS)
    for step, error, message in refusals:
        assert error == "TierInUseError", f"the second job's step {step}: {error}: {message}"
        assert holder in message and str(tmp_path / "nvme") in message
    assert found.steps == [1, *SHARED_STEPS]
    # Once the first job has closed, the tier takes a writer again.
    write_steps(tmp_path, [SHARED_STEPS[-1] + 1])
    assert audit(tmp_path).steps[-1] == SHARED_STEPS[-1] + 1
    tally("second_job", refused=len(refusals), durable=len(reported), losses=len(found.losses))


def test_gc_in_a_loop_beside_a_live_trainer_destroys_nothing_durable(tmp_path: Path) -> None:
    """``tierstate gc --older-than 0s`` in a loop from the trainer's first request to its exit: every
    partial is due for removal, only its writer's lock protects it."""
    tiers = tiers_of(tmp_path)
    ctx = trainer_context()
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=train, args=(str(tmp_path), 1, TRAINER_STEPS, None, theirs, {}))
    child.start()
    theirs.close()
    requested: list[int] = []
    durable: list[int] = []
    rounds: list[list[Leftover]] = []
    while True:
        if requested and len(rounds) < GC_ROUNDS and not ours.poll():
            rounds.append(collect_garbage(tiers, older_than=0))  # raises if gc itself fails
            continue
        try:
            kind, step = ours.recv()
        except EOFError:
            break
        (requested if kind == "requested" else durable).append(step)
    child.join()
    assert child.exitcode == 0
    assert durable == requested == list(range(1, TRAINER_STEPS + 1)), "gc made a checkpoint fail"
    met = [leftover for found in rounds for leftover in found]
    assert any(leftover.reason == "in use" for leftover in met), "gc never met the trainer's live partial"
    assert not any(leftover.removed and leftover.kind == "partial" for leftover in met)
    found = audit(tmp_path)
    assert found.losses == [] and found.partials == [] and found.steps == durable
    tally("gc_beside_trainer", rounds=len(rounds), checkpoints=len(durable), losses=len(found.losses))


def test_symlinks_planted_in_a_tier_are_never_followed(tmp_path: Path) -> None:
    """A lock file or a partial that is a symlink elsewhere: refused or left alone, its target untouched."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep me")
    nvme = tiers_of(tmp_path)[0]
    nvme.root.mkdir()
    (nvme.root / WRITER_LOCK_NAME).symlink_to(elsewhere / "precious")
    (nvme.root / "step-9.partial").symlink_to(elsewhere)
    with trainer(tmp_path) as (runner, state):
        state.advance(1)
        handle = runner.checkpoint(1)
        handle.wait()
    assert isinstance(handle.error, TierError) and handle.error.errno == errno.ELOOP, handle.error
    assert WRITER_LOCK_NAME in str(handle.error)
    found = collect_garbage([nvme], older_than=0)
    assert [(f.path.name, f.kind, f.removed) for f in found] == [("step-9.partial", "invalid", False)]
    assert found[0].reason.startswith("invalid, kept: step-9.partial: is a symlink, not a directory; never followed")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]
    assert (elsewhere / "precious").read_text() == "keep me"
