"""The handle's async contract: futures per stage and tier, callbacks, ``acheckpoint`` without a
thread, failures that stay quiet on stderr, and a history that does not grow with the run."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from conftest import DEFAULT_YAML, REPO
from tierstate import CheckpointFailed, CheckpointHandle, Runner
from tierstate.providers import ObjectProvider, TensorDictProvider

TIERED_YAML = REPO / "configs" / "tiered.yaml"


def _state(mib: int = 1) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(mib * 1024 * 1024 // 4, generator=torch.Generator().manual_seed(mib))}


def test_futures_follow_capture_commit_and_each_flush(make_runner, tmp_path):
    runner = make_runner(TIERED_YAML, tiers__pfs__flush={"every": 2, "workers": 1}, chunk_size="1MiB")
    runner.register(t=TensorDictProvider(_state(2)))
    called: queue.Queue[CheckpointHandle] = queue.Queue()
    odd, even = runner.checkpoint(1), runner.checkpoint(2)
    even.add_done_callback(called.put)
    assert even.result(60).path == tmp_path / "nvme" / "step-2"
    assert called.get(timeout=60) is even
    assert set(odd.tier_futures) == {"nvme"} and set(even.tier_futures) == {"nvme", "pfs"}  # flush.every: 2
    assert even.tier_futures["pfs"].result(60) == tmp_path / "pfs" / "step-2"
    assert even.persisted("pfs") and not odd.persisted("pfs") and odd.persisted("nvme")
    assert even.capture_future.result(0) is None and even.captured
    assert even.exception(0) is None and even.durable_future.result(0) == even.result()
    assert not even.durable_future.cancel(), "a waiter cancelled the checkpoint"
    late: list[CheckpointHandle] = []
    even.add_done_callback(late.append)  # already done: called at once, on this thread
    assert late == [even]


def test_failed_checkpoint_fails_every_future_with_checkpoint_failed(make_runner):
    runner = make_runner(TIERED_YAML)
    runner.register(t=TensorDictProvider(_state()), meta=ObjectProvider({"bad": {1, 2}}))  # a set is not msgpack
    handle = runner.checkpoint(1)
    error = handle.exception(60)
    assert isinstance(error, CheckpointFailed) and error.__cause__ is handle.error
    assert "step 1 failed" in str(error) and "set" in str(handle.error)
    for future in handle.tier_futures.values():
        assert future.exception(0) is error
    assert handle.durable_future.exception(0) is error
    assert not handle.persisted() and not handle.captured
    with pytest.raises(CheckpointFailed, match="step 1 failed"):
        handle.result()


def test_skipped_checkpoint_fails_its_futures_and_was_never_captured(make_runner):
    runner = make_runner(pipeline__stages__persist__bandwidth="64MiB", policies__in_flight="skip")
    runner.register(t=TensorDictProvider(_state(8)))
    first, second = runner.checkpoint(1), runner.checkpoint(2)
    assert second.skipped and second.done() and second.error is None
    assert isinstance(second.capture_future.exception(0), CheckpointFailed) and not second.captured
    assert "skipped" in str(second.exception(0))
    assert first.result(60).step == 1


def test_result_and_exception_time_out_while_in_flight(make_runner):
    runner = make_runner(pipeline__stages__persist__bandwidth="16MiB")  # 8 MiB: ~0.5 s in flight
    runner.register(t=TensorDictProvider(_state(8)))
    handle = runner.checkpoint(1)
    with pytest.raises(TimeoutError, match="step 1 not finished"):
        handle.result(0)
    with pytest.raises(TimeoutError, match="step 1 not finished"):
        handle.exception(0)
    assert handle.result(60).step == 1


async def test_acheckpoint_holds_no_executor_thread_while_it_waits(make_runner):
    """The loop's default executor has one thread and it is busy until every checkpoint is durable:
    awaiting checkpoints must not need it (they used to wait in it, and here they would never end)."""
    runner = make_runner(pipeline__stages__persist__bandwidth="64MiB", policies__in_flight="wait")
    runner.register(t=TensorDictProvider(_state(4)))
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
    release = threading.Event()
    busy = loop.run_in_executor(None, release.wait)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(runner.acheckpoint(step) for step in range(1, 6))), 60)
    finally:
        release.set()
        await busy
    assert [r.step for r in results] == [1, 2, 3, 4, 5]
    assert runner.steps()["nvme"] == [1, 2, 3, 4, 5]


async def test_a_waiter_that_gives_up_leaves_the_checkpoint_going(make_runner):
    """``acheckpoint`` awaits ``asyncio.wrap_future(durable_future)``; cancelling such an await tries to
    cancel the future it wraps, which must not cancel the checkpoint."""
    runner = make_runner(pipeline__stages__persist__bandwidth="64MiB")
    runner.register(t=TensorDictProvider(_state(4)))
    handle = runner.checkpoint(1)
    waiter = asyncio.wrap_future(handle.durable_future)
    waiter.cancel()
    await asyncio.sleep(0)  # one turn of the loop: the cancel reaches the wrapped future
    assert not handle.durable_future.cancelled()
    assert handle.result(60).step == 1 and runner.steps()["nvme"] == [1]


def test_history_keeps_a_bounded_window_of_the_latest(make_runner, tmp_path):
    assert make_runner().history.maxlen == 64
    tiers = {name: {"path": str(tmp_path / "small" / name)} for name in ("nvme", "pfs")}
    small = Runner.from_yaml(DEFAULT_YAML, {"tiers": tiers}, history_size=3)
    try:
        small.register(t=TensorDictProvider(_state()))
        for step in range(1, 8):
            small.checkpoint(step).result()
        assert [handle.step for handle, _stats in small.history] == [5, 6, 7]
        assert small.history[-1][1].raw_bytes == 1 << 20
    finally:
        small.close()


FAILING_TRAINER = textwrap.dedent(
    """
    import errno, sys
    import torch
    from tierstate import Runner, TensorDictProvider
    from tierstate.tiers.storage import faults

    root, steps = sys.argv[1], int(sys.argv[2])
    runner = Runner.from_yaml(sys.argv[3], {
        "tiers": {"nvme": {"path": root + "/nvme"}, "pfs": {"path": root + "/pfs"}},
        "chunk_size": "1MiB", "host_cache.size": "4MiB",
    })
    runner.register(t=TensorDictProvider({f"w{i}": torch.randn(300_000) for i in range(8)}))

    def failing_disk(_path):
        raise OSError(errno.EIO, "injected write error")

    with faults.inject("persist.write", failing_disk):
        failed = sum(runner.checkpoint(step).exception(60) is not None for step in range(steps))
    runner.close()
    print(failed)
    """
)


@pytest.mark.slow
def test_failed_checkpoints_print_no_unretrieved_future_tracebacks(tmp_path):
    """A disk that fails every write fails all writes in flight at once; each cancelled write's own
    error used to be printed by asyncio as "Future exception was never retrieved"."""
    steps = 60
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_TRAINER, str(tmp_path), str(steps), str(DEFAULT_YAML)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(steps)]
    assert "never retrieved" not in proc.stderr
    assert proc.stderr.count("injected write error") == steps  # one log line per failed checkpoint, nothing else
