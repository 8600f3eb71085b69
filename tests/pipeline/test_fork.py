"""A forked child owns nothing of its parent's runner: it never drains it, never waits on its loop
(which does not run in the child) and leaves its checkpoints to it. Real forks, real DataLoader workers."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tierstate import Runner, RunnerClosedError
from tierstate.providers import TensorDictProvider

FORK = multiprocessing.get_context("fork")


def _state(mib: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(mib * 1024 * 1024 // 4, generator=torch.Generator().manual_seed(mib))}


def _child_uses_its_copy(runner: Runner) -> None:
    """In the fork child: the runner is a closed copy; nothing waits, checkpointing says why it cannot.
    Returning lets the process exit through the interpreter's exit hooks, the runner's among them."""
    with pytest.raises(RunnerClosedError, match="forked child"):
        runner.checkpoint(99)
    assert runner.wait_captured() == 0.0
    runner.wait()
    runner.close()


def test_fork_child_of_a_process_with_a_checkpoint_in_flight_exits_and_joins(make_runner, tmp_path):
    runner = make_runner(pipeline__stages__persist__bandwidth="64MiB")  # 8 MiB: in flight ~0.12 s
    runner.register(t=TensorDictProvider(_state(8)))
    runner.checkpoint(1).result()
    in_flight = runner.checkpoint(2)
    child = FORK.Process(target=_child_uses_its_copy, args=(runner,))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0, f"fork child hung or failed (exit code {child.exitcode})"
    assert in_flight.result(60).step == 2
    runner.close()
    assert runner.steps()["nvme"] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir()) == ["step-1", "step-2"]  # nothing partial


class _Squares(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index * index])


def test_dataloader_workers_exit_normally_while_a_runner_lives(make_runner):
    """Each worker is a fork child; one that hangs at exit is joined for 5 s, then killed by SIGTERM,
    which torch's worker handler turns into exit code 0: so the time is the evidence (10 s an epoch
    with two hanging workers, well under 1 s without)."""
    runner = make_runner()
    runner.register(t=TensorDictProvider(_state(1)))
    runner.checkpoint(1).result()
    loader = DataLoader(_Squares(), batch_size=8, num_workers=2, multiprocessing_context=FORK)
    for epoch in range(2):
        started = time.perf_counter()
        batches = iter(loader)
        total = sum(int(batch.sum()) for batch in batches)  # exhausting it shuts the workers down
        elapsed = time.perf_counter() - started
        assert total == sum(i * i for i in range(64))
        assert elapsed < 4.0, f"epoch {epoch} took {elapsed:.1f} s: workers waited at exit"
    assert runner.checkpoint(2).result().step == 2
