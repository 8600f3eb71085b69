"""A memory tier captured into (tiers/storage/slots.py) under real faults: too small a tmpfs, a full one, kills.

The slots are the data files themselves, reused: a kill while capture overwrites a recycled file, or
while the commit publishes it, must leave every committed checkpoint bit-exact (the file being written
is never a committed one's), nothing torn listed or restored, and a restarted trainer restoring the newest
step and adopting the killed writer's pool. The size limits run on a real, small tmpfs (mounted here;
skipped where mounting is not permitted): refused when the runner is built, never a SIGBUS later.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from faultkit import audit_tiers, run_trainer, state_matches, tmpfs, trainer
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.ops.retention import collect_garbage, leftovers
from tierstate.tiers.storage.filesystem import FilesystemTier, TierError
from tierstate.tiers.storage.slotdirs import free_files, pool_dir

pytestmark = pytest.mark.faults

MiB = 1 << 20
STEPS = 6
# capture: 4 chunks a checkpoint, so @9 is the 3rd checkpoint's first chunk (a recycled slot by then)
KILLS = [("capture", 9), ("capture", 16), ("begin", 4), ("commit.manifest", 3), ("commit.rename", 4),
         ("prune.delete", 2)]  # fmt: skip


def memory_runner(memory: Path, size: str) -> Runner:
    return Runner.from_dict({
        "chunk_size": "1MiB",
        "host_cache": {"size": "8MiB"},
        "tiers": {"memory": {"kind": "memory", "path": str(memory), "size": size, "retention": {"keep_last": 1}}},
    })  # fmt: skip


def _extra(memory: Path) -> dict[str, Any]:
    """faultkit's trainer, persisting to a memory tier at ``memory`` (keep_last 1: every file recycled)."""
    tier = {"kind": "memory", "path": str(memory), "size": "32MiB", "retention": {"keep_last": 1}}
    return {"tiers": {"memory": tier}, "pipeline__stages__persist__tier": "memory"}


@pytest.mark.parametrize(("point", "nth"), KILLS)
def test_a_kill_while_a_slot_is_written_or_committed_never_tears_a_checkpoint(
    memory_dir: Path, point: str, nth: int
) -> None:
    extra = _extra(memory_dir)
    trial = run_trainer(memory_dir.parent, 1, STEPS, fault=f"{point}@{nth}", extra=extra)
    assert trial.exitcode == -signal.SIGKILL
    memory = FilesystemTier("memory", memory_dir)
    found = audit_tiers([memory])
    assert found.losses == [] and found.steps, found
    assert max(found.steps) >= max(trial.durable, default=0), "a step reported durable was lost"
    with trainer(memory_dir.parent, **extra) as (runner, state):
        assert runner.restore("latest").step == max(found.steps)
        assert state_matches(state, max(found.steps))
        for step in range(max(found.steps) + 1, max(found.steps) + 4):
            state.advance(step)
            assert runner.checkpoint(step).result().step == step
        pool = pool_dir(memory_dir, 0)
        assert len(free_files(pool)) <= 2, "the killed writer's pool was adopted, not left to grow"
    after = audit_tiers([memory])
    assert after.losses == [] and after.steps[-1] == max(found.steps) + 3
    collect_garbage([memory], older_than=0)
    assert leftovers(memory) == []


def test_a_kill_at_a_random_moment_leaves_the_newest_committed_step_restorable(memory_dir: Path) -> None:
    extra = _extra(memory_dir)
    for delay in (0.05, 0.2, 0.45):
        trial = run_trainer(memory_dir.parent, 1, 40, kill_after=delay, extra=extra)
        found = audit_tiers([FilesystemTier("memory", memory_dir)])
        assert found.losses == [], (delay, trial)
        if found.steps:
            with trainer(memory_dir.parent, **extra) as (runner, state):
                assert runner.restore("latest").step == max(found.steps)
                assert state_matches(state, max(found.steps))


def test_a_tmpfs_smaller_than_the_tier_is_refused_when_the_runner_is_built(tmp_path: Path) -> None:
    """Docker's 64 MB /dev/shm, scaled down: the runner refuses at once, naming the key, the bytes and the fix."""
    with tmpfs(tmp_path / "shm", "4m") as shm:
        with pytest.raises(TierError) as caught:
            memory_runner(shm / "tier", size="16MiB")
        text = str(caught.value)
        assert "tiers.memory.size is 16.0MiB" in text and str(shm / "tier") in text
        assert "room for 4.0MiB" in text and "--shm-size" in text
        assert not (shm / "tier" / ".slots").exists()


def test_a_full_tmpfs_fails_the_checkpoint_with_enospc_never_sigbus(tmp_path: Path) -> None:
    """The file system fills after the runner was built (another process's files): the slot cannot be
    allocated, the checkpoint fails naming the tier, training goes on; with room again it succeeds."""
    with tmpfs(tmp_path / "shm", "8m") as shm:
        runner = memory_runner(shm / "tier", size="8MiB")
        runner.register(weights=TensorDictProvider({"w": torch.randn(3 * MiB // 4)}))
        filler = shm / "filler"
        filler.write_bytes(bytes(6 * MiB))
        handle = runner.checkpoint(1)
        assert handle.exception() is not None
        assert "tier memory" in str(handle.exception()) and "tiers.memory.size" in str(handle.exception())
        filler.unlink()
        assert runner.checkpoint(2).result().step == 2
        runner.close()
