"""Concurrency: checkpoints requested faster than they persist follow the policy and never mix, and
a restore running beside a checkpoint or a migration only ever sees committed, whole checkpoints.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from faultkit import (
    DEFAULT_YAML,
    StepState,
    audit,
    make_runner,
    overrides,
    state_matches,
    tally,
    tiers_of,
    trainer,
    write_steps,
)
from tierstate.pipeline.runner import Runner
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.storage import faults

pytestmark = pytest.mark.faults

SLOW = "24MiB"  # 3.8 MiB per checkpoint: ~160 ms each, far longer than a request takes


@pytest.mark.parametrize("policy", ["wait", "skip"])
def test_requests_faster_than_persist_follow_the_policy(tmp_path: Path, policy: str) -> None:
    handles = []
    with trainer(tmp_path, pipeline__stages__persist__bandwidth=SLOW, policies__in_flight=policy) as (runner, state):
        for step in range(1, 9):
            state.advance(step)  # the state changes as soon as the previous capture is done
            previous = handles[-1] if handles else None
            handles.append(runner.checkpoint(step))
            if policy == "wait" and previous is not None:
                assert previous.done(), "policy wait returned before the previous checkpoint was durable"
            runner.wait_captured()
        for handle in handles:
            handle.wait()
    skipped = [h.step for h in handles if h.skipped]
    committed = [h.step for h in handles if not h.skipped and h.error is None]
    assert (skipped == []) if policy == "wait" else (skipped != [])
    assert sorted(skipped + committed) == list(range(1, 9))
    found = audit(tmp_path)
    assert found.steps == committed and found.partials == [] and found.losses == []
    tally("policy_" + policy, checkpoints=len(committed), skipped=len(skipped), losses=0)


def test_many_threads_requesting_at_once(tmp_path: Path) -> None:
    """Requests from several threads are serialized by the runner: each commits whole, none interleave."""
    runner = make_runner(tmp_path, pipeline__stages__persist__bandwidth="96MiB")
    state = StepState()
    state.advance(7)  # constant state: every step must read back as the state of step 7
    state.register(runner)
    errors: list[BaseException] = []

    def request(first: int) -> None:
        try:
            for step in range(first, 40, 4):
                runner.checkpoint(step).result()
        except BaseException as exc:  # reported to the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=request, args=(first,)) for first in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    runner.close()
    assert errors == []
    directory = tiers_of(tmp_path)[0]
    assert directory.steps() == list(range(40)) and directory.partials() == []
    with trainer(tmp_path) as (reader, check):
        for step in (0, 13, 39):
            reader.restore(step)
            assert state_matches(check, 7)


class Reader:
    """A second runner restoring "latest" each time it is called (from a fault point), checking each
    restore bit-exact against its step; ``pfs_first`` lists pfs before nvme, so a partial copy on
    pfs would be the first thing it tries. It reads the writer's tiers and writes a tier of its own
    (first, empty: restore reads past it), as another job restoring from them would: one process's
    runners never write one tier together (pipeline/holders.py)."""

    def __init__(self, root: Path, pfs_first: bool = False) -> None:
        settings = overrides(root)
        tiers = settings["tiers"]
        read = ("pfs", "nvme") if pfs_first else ("nvme", "pfs")
        settings["tiers"] = {"reader": {"path": str(root / "reader")}, **{name: tiers[name] for name in read}}
        settings["pipeline.stages.persist.tier"] = "reader"
        self.runner = Runner.from_yaml(DEFAULT_YAML, settings)
        self.state = StepState()
        self.state.register(self.runner)
        self.seen: list[tuple[int, str]] = []

    def __call__(self, _path: Path | None = None) -> tuple[int, str]:
        result = self.runner.restore("latest")  # another runner: it does not wait for the writer
        assert state_matches(self.state, result.step)
        self.seen.append((result.step, result.tier))
        return self.seen[-1]

    def close(self) -> None:
        self.runner.close()


def test_restore_beside_a_checkpoint_in_flight_sees_only_committed_steps(tmp_path: Path) -> None:
    write_steps(tmp_path, range(1, 3))
    writer = make_runner(tmp_path, pipeline__stages__persist__bandwidth=SLOW)
    state = StepState()
    state.register(writer)
    reader = Reader(tmp_path)
    try:
        state.advance(3)
        with faults.inject("persist.write", reader), faults.inject("commit.manifest", reader):
            writer.checkpoint(3).result()
        # During every frame write and just before the rename, only step 2 exists.
        assert set(reader.seen) == {(2, "nvme")} and len(reader.seen) >= 5
        assert writer.restore("latest").step == 3 and state_matches(state, 3)
    finally:
        writer.close()
        reader.close()


def test_restore_during_a_migration_never_uses_the_partial_copy(tmp_path: Path) -> None:
    """The reader lists pfs first, where step 3 is being copied frame by frame: it must take nvme's."""
    write_steps(tmp_path, range(1, 4))
    nvme, pfs = tiers_of(tmp_path)
    migrate(1, nvme, pfs)
    reader = Reader(tmp_path, pfs_first=True)
    try:
        with faults.inject("migrate.frame", reader):
            migrate(3, nvme, pfs)
        assert reader.seen and set(reader.seen) == {(3, "nvme")}
        assert reader() == (3, "pfs")
    finally:
        reader.close()


def test_restore_while_the_runners_background_flush_runs(tmp_path: Path) -> None:
    """During every frame a background flush copies to pfs, a restore takes the committed nvme copy."""
    writer = make_runner(tmp_path, tiers__pfs__flush={"every": 1})
    state = StepState()
    state.register(writer)
    reader = Reader(tmp_path, pfs_first=True)
    try:
        with faults.inject("migrate.frame", reader):
            for step in range(1, 4):
                state.advance(step)
                writer.checkpoint(step).result()
            writer.close()  # drains the flushes
        assert len(reader.seen) >= 3 * 5 and {tier for _, tier in reader.seen} == {"nvme"}
        assert writer.flush_failures == [] and tiers_of(tmp_path)[1].steps() == [1, 2, 3]
        assert reader() == (3, "pfs")
    finally:
        writer.close()
        reader.close()
