"""Full, failing, read-only, vanished and slow storage: a checkpoint fails cleanly, training goes on.

The faults are real where the kernel can give them: ENOSPC from /dev/full and from a full tmpfs,
EIO from /proc/self/mem (a write to an unmapped address), EROFS from a read-only bind mount, ENOENT
from a directory removed mid-checkpoint. Fault points only choose the moment (turn the data file's
descriptors to the device before a frame write, remove the directory during one); the two faults the
kernel cannot be asked for on demand, a transient EIO and a failing fsync, are raised there.
Each test checks: the error is on the handle and in the log and names the file, the previous
checkpoint is untouched, the host cache is returned, and the next checkpoint works.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from faultkit import (
    StepState,
    bind,
    make_runner,
    open_fds,
    rss_bytes,
    scaled,
    set_read_only,
    snapshot,
    state_matches,
    tally,
    tiers_of,
    tmpfs,
)
from tierstate.pipeline.handle import CheckpointHandle
from tierstate.pipeline.runner import Runner
from tierstate.tiers.ops.retention import collect_garbage
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import TierError

pytestmark = pytest.mark.faults

DATA = "rank-00000.data"
FAST_RETRY = {"pipeline__stages__persist__retries": 2, "pipeline__stages__persist__backoff": 0.001}


class Trainer:
    """A runner with the known state, one committed step, and helpers to check a failed one."""

    def __init__(self, root: Path, **extra: object) -> None:
        self.root = root
        self.runner: Runner = make_runner(root, **extra)
        self.state = StepState()
        self.state.register(self.runner)
        self.step(1).result()
        self.good = snapshot(tiers_of(root)[0].step_dir(1))

    def step(self, step: int) -> CheckpointHandle:
        self.state.advance(step)
        handle = self.runner.checkpoint(step)
        self.runner.wait_captured()
        return handle

    def failed(self, handle: CheckpointHandle, code: int, names: str, log: str) -> TierError:
        """The checkpoint failed with ``code``, naming ``names``, on its handle and in the log; nothing else."""
        assert handle.wait(60) and isinstance(handle.error, TierError), handle.error
        assert handle.error.errno == code and names in str(handle.error), handle.error
        assert f"checkpoint step {handle.step} failed" in log and os.strerror(code) in log
        assert self.runner.cache.in_use == 0, "a failed checkpoint kept host-cache slabs"
        assert snapshot(tiers_of(self.root)[0].step_dir(1)) == self.good, "the previous checkpoint changed"
        return handle.error

    def carries_on(self, step: int) -> None:
        """Training goes on: the next checkpoint commits, and restore finds it bit-exact."""
        assert self.step(step).result().step == step
        assert self.runner.restore("latest").step == step and state_matches(self.state, step)

    def close(self) -> None:
        self.runner.close()


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[Trainer]:
    trainer = Trainer(tmp_path)
    yield trainer
    trainer.close()


def _onto(device: str):
    """A persist.write handler that points this process's descriptors on the data file being
    written at ``device`` (``dup2``), so the write that follows fails as that device does.

    (A symlink planted under the data file's name no longer reaches a device: tierstate creates the
    file new and never follows one, see test_hostile_files.)
    """

    def redirect(_path: Path | None) -> None:
        target = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
        try:
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").endswith(f".partial/{DATA}"):
                        os.dup2(target, int(fd))
                except OSError:
                    continue  # closed meanwhile (the listing's own descriptor, another thread's)
        finally:
            os.close(target)

    return redirect


def test_disk_full_fails_the_checkpoint_not_training(trainer: Trainer, caplog) -> None:
    with faults.inject("persist.write", _onto("/dev/full")):
        handle = trainer.step(2)
        handle.wait()
    error = trainer.failed(handle, errno.ENOSPC, f"{DATA} frame", caplog.text)
    assert str(tiers_of(trainer.root)[0].partial_dir(2) / DATA) in str(error)
    assert tiers_of(trainer.root)[0].partials() == []  # the failed write was removed
    trainer.carries_on(3)
    tally("disk_full", faults=1, losses=0)


def test_eio_is_retried_then_reported(tmp_path: Path, caplog) -> None:
    trainer = Trainer(tmp_path, **FAST_RETRY)
    try:
        caplog.set_level(logging.WARNING, logger="tierstate")
        with faults.inject("persist.write", _onto("/proc/self/mem")):  # every write there is EIO
            handle = trainer.step(2)
            handle.wait()
        error = trainer.failed(handle, errno.EIO, "(after 2 retries)", caplog.text)
        assert f"{DATA} frame" in str(error) and caplog.text.count("retry ") >= 2
        trainer.carries_on(3)
    finally:
        trainer.close()
    tally("eio_write", faults=3, losses=0)


def test_transient_errors_are_retried_with_backoff(tmp_path: Path, caplog) -> None:
    raised = []

    def three_times(_path: Path | None) -> None:
        if len(raised) < 3:
            raised.append(1)
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    # One buffered writer, so the three errors hit the same frame in a row (O_DIRECT falls back on its own).
    persist = {"workers": 1, "io": "buffered", "retries": 3, "backoff": 0.01}
    trainer = Trainer(tmp_path, **{f"pipeline__stages__persist__{k}": v for k, v in persist.items()})
    try:
        caplog.set_level(logging.WARNING, logger="tierstate")
        with faults.inject("persist.write", three_times):
            assert trainer.step(2).result().step == 2
        retries = [line.split("; ")[-1] for line in caplog.text.splitlines() if "retry" in line]
        assert retries == ["retry 1 of 3 in 0.01 s", "retry 2 of 3 in 0.02 s", "retry 3 of 3 in 0.04 s"]
        assert trainer.runner.restore("latest").step == 2 and state_matches(trainer.state, 2)
    finally:
        trainer.close()
    tally("transient_eio", faults=3, losses=0)


def test_without_retries_a_transient_error_fails_at_once(trainer: Trainer, caplog) -> None:
    def always(_path: Path | None) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with faults.inject("persist.write", always):
        handle = trainer.step(2)
        handle.wait()
    trainer.failed(handle, errno.EIO, f"{DATA} frame", caplog.text)
    assert "retry" not in caplog.text
    trainer.carries_on(3)


def test_a_failed_fsync_is_never_retried(tmp_path: Path, caplog) -> None:
    """After a failed fsync the kernel may have dropped the pages; a retry could 'succeed' on lost data."""
    calls = []

    def fail_once(path: Path | None) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    trainer = Trainer(tmp_path, **FAST_RETRY)
    try:
        with faults.inject("persist.fsync", fail_once):
            handle = trainer.step(2)
            handle.wait()
        trainer.failed(handle, errno.EIO, f"fsync of {tiers_of(tmp_path)[0].partial_dir(2) / DATA}", caplog.text)
        assert len(calls) == 1 and "retry" not in caplog.text
        trainer.carries_on(3)
    finally:
        trainer.close()


def test_a_full_file_system_fails_cleanly_and_transient_full_is_retried(tmp_path: Path, caplog) -> None:
    """A real 6 MiB tmpfs: one 3.8 MiB checkpoint fits, two do not; space freed during backoff is used."""
    with tmpfs(tmp_path / "nvme", "6m"):
        trainer = Trainer(tmp_path, **FAST_RETRY)
        try:
            handle = trainer.step(2)
            handle.wait()
            trainer.failed(handle, errno.ENOSPC, "(after 2 retries)", caplog.text)
            assert tiers_of(tmp_path)[0].partials() == []  # removed, so its space is free again
            # Make room only once the pipeline has hit ENOSPC and said it will retry.
            (tmp_path / "nvme" / "step-1").rename(tmp_path / "nvme" / "old")
            ballast = tmp_path / "nvme" / "old"
            freed = _on_log("retry 1 of", lambda: shutil.rmtree(ballast))
            handle = trainer.step(3)
            assert handle.result().step == 3 and not ballast.exists() and freed
            assert trainer.runner.restore("latest").step == 3 and state_matches(trainer.state, 3)
        finally:
            logging.getLogger("tierstate").handlers.clear()
            trainer.close()
    tally("tmpfs_full", faults=2, losses=0)


def _on_log(text: str, action) -> list[str]:
    """Run ``action`` once, synchronously, when the tierstate logger emits a record containing ``text``."""
    done: list[str] = []

    class Trigger(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not done and text in record.getMessage():
                done.append(record.getMessage())
                action()

    logging.getLogger("tierstate").addHandler(Trigger())
    return done


def test_a_read_only_tier_fails_cleanly(tmp_path: Path, caplog) -> None:
    with bind(tmp_path / "nvme"):
        trainer = Trainer(tmp_path)
        try:
            set_read_only(tmp_path / "nvme", True)
            handle = trainer.step(2)
            handle.wait()
            trainer.failed(handle, errno.EROFS, "step-2.partial", caplog.text)
            # Read-only while the checkpoint is being written: even its partial cannot be removed.
            set_read_only(tmp_path / "nvme", False)
            with faults.inject("begin", lambda _p: set_read_only(tmp_path / "nvme", True)):
                handle = trainer.step(3)
                handle.wait()
            trainer.failed(handle, errno.EROFS, DATA, caplog.text)
            assert trainer.runner.steps()["nvme"] == [1]  # the stuck partial is not listed
            set_read_only(tmp_path / "nvme", False)
            trainer.carries_on(4)
            removed = collect_garbage(tiers_of(tmp_path), older_than=0)
            assert [r.path.name for r in removed if r.removed] == ["step-3.partial"]
        finally:
            set_read_only(tmp_path / "nvme", False)
            trainer.close()
    tally("read_only", faults=2, losses=0)


def test_a_directory_that_vanishes_mid_checkpoint(trainer: Trainer, caplog) -> None:
    partial = tiers_of(trainer.root)[0].partial_dir(2)
    with faults.inject("persist.write", lambda _p: shutil.rmtree(partial, ignore_errors=True)):
        handle = trainer.step(2)
        handle.wait()
    trainer.failed(handle, errno.ENOENT, "step-2.partial", caplog.text)
    trainer.carries_on(3)


def test_a_tier_that_vanishes_mid_checkpoint(trainer: Trainer, caplog) -> None:
    root = tiers_of(trainer.root)[0].root
    with faults.inject("persist.write", lambda _p: shutil.rmtree(root, ignore_errors=True)):
        handle = trainer.step(2)
        handle.wait()
    assert isinstance(handle.error, TierError) and handle.error.errno == errno.ENOENT
    assert "checkpoint step 2 failed" in caplog.text and trainer.runner.cache.in_use == 0
    trainer.carries_on(3)  # the tier directory is created again


def test_a_very_slow_tier_never_holds_training_up(tmp_path: Path) -> None:
    """8 MiB/s for 3.8 MiB: ~0.5 s per checkpoint. With policy skip the trainer runs ahead at full speed."""
    trainer = Trainer(tmp_path, pipeline__stages__persist__bandwidth="8MiB", policies__in_flight="skip")
    try:
        rss = rss_bytes()
        handles, started = [], time.monotonic()
        for step in range(2, 42):
            handles.append(trainer.step(step))
        ran = time.monotonic() - started
        durable = [h for h in handles if not h.skipped]
        assert all(h.skipped or h is durable[-1] or h.done() for h in handles)  # at most one in flight
        assert ran < 0.47 * len(handles) / 2, "the trainer waited for the slow tier"
        assert rss_bytes() - rss < 32 << 20 and trainer.runner.cache.peak_in_use <= trainer.runner.cache.slab_count
        assert durable[-1].result().step == durable[-1].step  # the last one still becomes durable
    finally:
        trainer.close()
    assert all(h.done() for h in handles)


def test_failing_checkpoints_leak_no_memory_or_descriptors(trainer: Trainer) -> None:
    with faults.inject("persist.write", _onto("/dev/full")):
        trainer.step(2).wait()  # warm up: the first failure allocates the logging and error paths
        fds, rss = open_fds(), rss_bytes()
        rounds = scaled(30)
        for step in range(3, 3 + rounds):
            handle = trainer.step(step)
            assert handle.wait(60) and handle.error is not None and trainer.runner.cache.in_use == 0
    assert open_fds() == fds and rss_bytes() - rss < 16 << 20
    trainer.carries_on(3 + rounds)
    tally("failing_loop", faults=rounds + 1, losses=0)


def test_retention_never_deletes_the_last_good_copy(tmp_path: Path, caplog) -> None:
    """nvme keeps only the newest step, pfs should receive every step but cannot be created (its
    parent is a file): every flush fails, so nvme must keep them all; a failed checkpoint then
    must not count as the newest."""
    blocker = tmp_path / "not-a-dir"
    pfs = {"path": str(blocker / "pfs"), "flush": {"every": 1}}

    def block(_partial: Path | None) -> None:
        """Tier paths are checked when the runner is built; the PFS's goes bad at the first checkpoint."""
        if blocker.is_dir():
            shutil.rmtree(blocker)
            blocker.write_text("a file where the pfs tier's parent directory should be")

    with faults.inject("begin", block):
        trainer = Trainer(tmp_path, tiers__nvme__retention={"keep_last": 1}, tiers__pfs=pfs)
    try:
        handles = [trainer.step(step) for step in (2, 3)]
        assert all(h.result() for h in handles)
        with faults.inject("persist.write", _onto("/dev/full")):
            failed = trainer.step(4)
            failed.wait()
        trainer.runner.close()  # drains the flushes and the pruning after them
        assert isinstance(failed.error, TierError) and failed.error.errno == errno.ENOSPC
        assert all("pfs" in h.flush_errors for h in handles) and "flush of step 3 to tier pfs failed" in caplog.text
        assert tiers_of(tmp_path)[0].steps() == [1, 2, 3], "retention deleted a copy that pfs never received"
        assert snapshot(tiers_of(tmp_path)[0].step_dir(1)) == trainer.good
    finally:
        trainer.close()
    tally("retention_last_copy", faults=4, losses=0)
