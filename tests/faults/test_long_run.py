"""Long runs: hundreds of checkpoints leave memory, descriptors, threads and tasks where they were;
a runner closes and reopens cleanly; a trainer that forgets close() leaves nothing half-made.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from faultkit import audit, make_runner, open_fds, rss_bytes, run_forgetful, scaled, tally, tiers_of
from tierstate.pipeline.runner import Runner
from tierstate.providers import ObjectProvider
from tierstate.providers.items import TensorItem
from tierstate.tiers.ops.retention import collect_garbage, leftovers
from tierstate.tiers.reading.stored import StoredCheckpoint

pytestmark = pytest.mark.faults


class Small:
    """A 96 KiB state that changes every step, so every checkpoint differs from the last."""

    def __init__(self) -> None:
        self.w = torch.zeros(16 * 1024)
        self.b = torch.zeros(8 * 1024, dtype=torch.float64)

    def set(self, step: int) -> None:
        self.w.fill_(step)
        self.b.fill_(-step)

    def describe(self) -> list[TensorItem]:
        return [TensorItem("w", self.w), TensorItem("b", self.b)]

    def restore(self, state) -> None:
        self.w.copy_(state["w"])
        self.b.copy_(state["b"])


def _tasks(runner: Runner) -> int:
    """Tasks alive on the runner's loop, not counting the one asking."""

    async def count() -> int:
        return len(asyncio.all_tasks()) - 1

    return asyncio.run_coroutine_threadsafe(count(), runner._engine.loop).result()


def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def _pool_threads(runner: Runner) -> set[str]:
    """Every thread name the runner's fixed-size pools may ever start: a pool starts its threads
    lazily, so one may first appear after the warm-up without being a leak."""
    pools = [runner._engine.compute, runner._engine.io, runner._flusher._pool]
    return {f"{pool._thread_name_prefix}_{i}" for pool in pools for i in range(pool._max_workers)}


def test_hundreds_of_checkpoints_leak_nothing(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    state, counters = Small(), {"step": 0}
    runner.register(s=state, meta=ObjectProvider(counters))
    for step in range(1, 21):  # warm up: thread pools, allocator arenas, logging, import caches
        state.set(step)
        runner.checkpoint(step).result()
    fds, rss, threads = open_fds(), rss_bytes(), _threads()
    last = 20 + scaled(300)
    for step in range(21, last + 1):
        state.set(step)
        counters["step"] = step
        handle = runner.checkpoint(step)
        runner.wait_captured()
        assert handle.result().step == step
    grown = rss_bytes() - rss
    assert open_fds() == fds, "file descriptors leaked"
    started = Counter(_threads()) - Counter(threads)
    assert set(started) <= _pool_threads(runner) and set(started.values()) <= {1}, f"threads leaked: {started}"
    assert _tasks(runner) == 0, "asyncio tasks leaked"
    assert runner.cache.in_use == 0
    assert grown < 24 << 20, f"RSS grew by {grown >> 20} MiB over {last - 20} checkpoints"
    assert runner.steps()["nvme"] == list(range(1, last + 1))
    runner.close()
    tally("long_run", checkpoints=last, losses=0, rss_growth_kib=grown >> 10)

    # Reopen on the same tiers: the newest checkpoint is there, bit-exact, and the run goes on.
    reopened = make_runner(tmp_path)
    again, counters = Small(), {}
    reopened.register(s=again, meta=ObjectProvider(counters))
    assert reopened.restore("latest").step == last and counters == {"step": last}
    assert bool((again.w == last).all()) and bool((again.b == -last).all())
    again.set(last + 1)
    assert reopened.checkpoint(last + 1).result().step == last + 1
    reopened.close()
    reopened.close()  # closing twice is harmless


def test_runners_opened_and_closed_leave_no_threads_or_descriptors(tmp_path: Path) -> None:
    probe = make_runner(tmp_path)  # the first runner pays for one-time imports and allocations
    probe.close()
    fds, threads = open_fds(), _threads()
    for step in range(1, scaled(20) + 1):
        with make_runner(tmp_path) as runner:
            state = Small()
            state.set(step)
            runner.register(s=state)
            runner.checkpoint(step)  # left in flight: close() must drain it
        assert runner.steps()["nvme"][-1] == step
    assert open_fds() == fds and _threads() == threads


@pytest.mark.parametrize("hard_exit", [False, True], ids=["returns", "os._exit"])
def test_a_trainer_that_forgets_close(tmp_path: Path, hard_exit: bool) -> None:
    """Returning: the exit handler drains, step 2 is durable. os._exit: step 2 is committed or a partial."""
    assert run_forgetful(tmp_path, hard_exit) == 0
    found = audit(tmp_path)
    assert found.losses == []
    if not hard_exit:
        assert found.steps == [1, 2] and found.partials == []
    else:
        assert found.steps in ([1], [1, 2]) and found.partials in ([], ["step-2.partial"])
        assert len(found.steps) + len(found.partials) == 2
    assert StoredCheckpoint(tiers_of(tmp_path)[0].step_dir(1)).read()["meta/value"] == {"step": 1}
    collect_garbage(tiers_of(tmp_path), older_than=0)
    assert audit(tmp_path).partials == [] and audit(tmp_path).steps == found.steps


# nvme keeps the newest 3; every 10th step is flushed to pfs, which keeps the newest 2 of those.
RETENTION = {
    "tiers__nvme__retention": {"keep_last": 3},
    "tiers__pfs__flush": {"every": 10},
    "tiers__pfs__retention": {"keep_last": 2},
}


def test_hundreds_of_checkpoints_with_flush_and_retention(tmp_path: Path) -> None:
    """Disk use stays bounded by the policies, memory stays flat, and closing leaves nothing running."""
    fds, threads = open_fds(), _threads()
    runner = make_runner(tmp_path, **RETENTION)
    state = Small()
    runner.register(s=state)
    nvme, pfs = tiers_of(tmp_path)
    last, most = 10 + scaled(300), 0
    for step in range(1, last + 1):
        state.set(step)
        runner.checkpoint(step).result()
        if step == 10:
            rss = rss_bytes()
        # Retention runs in the background, so how far it lags is timing; what it keeps is not.
        held = nvme.steps()
        most = max(most, len(held))
        assert step in held, "retention deleted the newest checkpoint"
        flushed = set(pfs.steps()) | set(held)
        assert all(s in flushed for s in range(max(1, step - 9), step + 1) if s % 10 == 0), "a step due on pfs was lost"
    grown = rss_bytes() - rss
    runner.close()
    assert runner.flush_failures == []
    assert nvme.steps() == list(range(last - 2, last + 1))
    assert pfs.steps() == [s for s in range(1, last + 1) if s % 10 == 0][-2:]
    for tier in (nvme, pfs):
        for step in tier.steps():
            values = StoredCheckpoint(tier.step_dir(step)).read()
            assert bool((values["s/w"] == step).all()) and bool((values["s/b"] == -step).all())
    assert [p for t in (nvme, pfs) for p in leftovers(t)] == []
    assert grown < 24 << 20, f"RSS grew by {grown >> 20} MiB over {last - 10} checkpoints"
    assert open_fds() == fds and _threads() == threads, "descriptors or threads outlived close()"
    tally("long_run_retention", checkpoints=last, losses=0, rss_growth_kib=grown >> 10, most_on_nvme=most)
