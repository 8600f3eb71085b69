"""The handle ``runner.checkpoint(step)`` returns at once, and what it reports later.

It is the trainer's only view of a checkpoint in flight: whether its tensors are captured (so the
optimizer may step), on which tiers it is durable, how long it blocked training, and, if it
failed, why. A failure is reported here and in the log; it is never raised into the training loop
unless the trainer asks for ``result()``.

The handle is a read side over ``concurrent.futures.Future`` s, as DCP's ``AsyncSaveResponse`` and
TorchSnapshot's ``PendingSnapshot`` are: ``capture_future`` (the state may change from now on),
``durable_future`` (committed on the persist tier; the handle's ``result()``) and one future per tier
the checkpoint is due on (``tier_futures``: the persist tier, then the tiers a background flush copies
it to). Futures compose with the rest of Python: ``add_done_callback``, ``concurrent.futures.wait``,
``asyncio.wrap_future``. They are born running, so nobody outside can cancel them: a trainer that
stops waiting (a cancelled ``await``) leaves the checkpoint going.

Only :class:`HandleCompleter`, the write side the runner and its flusher hold, resolves them, on the
runner's loop thread (or on the trainer's, for a checkpoint that never reached the loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from tierstate.errors import TierstateError

from .laziness import EagerSnapshot
from .metrics import CheckpointStats, Outcome
from .trace import marked

T = TypeVar("T")
log = logging.getLogger("tierstate")


class CheckpointFailed(TierstateError, RuntimeError):
    """Raised by ``result()`` for a checkpoint that failed or was skipped; ``__cause__`` is why it failed."""


@dataclass(frozen=True)
class CheckpointResult:
    step: int
    tier: str
    path: Path
    raw_bytes: int
    stored_bytes: int
    capture_s: float
    durable_s: float

    @classmethod
    def of(cls, step: int, tier: str, path: Path, stats: CheckpointStats) -> CheckpointResult:
        """The result of a checkpoint committed at ``path`` on ``tier``, from its stats."""
        return cls(step, tier, path, stats.raw_bytes, stats.stored_bytes, stats.capture_s, stats.durable_s)


def _running_future() -> concurrent.futures.Future[Any]:
    """A future no waiter can cancel: cancel() refuses a running future."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


def _succeeded(future: concurrent.futures.Future[Any]) -> bool:
    return future.done() and future.exception() is None


class CheckpointHandle:
    """One checkpoint's progress; made by :class:`HandleCompleter`, never by the trainer."""

    def __init__(
        self,
        step: int,
        capture: concurrent.futures.Future[None],
        durable: concurrent.futures.Future[CheckpointResult],
        tiers: Mapping[str, concurrent.futures.Future[Path | str]],
    ) -> None:
        self.step = step
        # What this checkpoint cost (bytes, seconds and GB/s per stage, queue peaks, blocked time);
        # filled in as it runs, final once done().
        self.stats = CheckpointStats(step)
        self.skipped = False
        self.error: BaseException | None = None
        # What result() raises for a failed or skipped checkpoint (its cause: ``error``); set before it resolves.
        self.failure: CheckpointFailed | None = None
        # Background flushes to slower tiers that failed (tier -> error); the checkpoint itself is fine.
        self.flush_errors: dict[str, BaseException] = {}
        self._capture = capture
        self._durable = durable
        self._tiers = MappingProxyType(dict(tiers))

    def __repr__(self) -> str:
        if self.skipped:
            state = "skipped"
        elif self.error is not None:
            state = "failed"
        else:
            state = "durable" if self._durable.done() else "in flight"
        return f"<CheckpointHandle step={self.step} {state}>"

    @property
    def blocked_s(self) -> float:
        """Seconds the trainer spent in checkpoint() plus in the step pre-hook waiting for this capture."""
        return self.stats.blocked_s

    @property
    def snapshot(self) -> EagerSnapshot:
        """The tensors copied on the trainer's thread before checkpoint() returned (they may change at
        any time, pipeline/laziness.py); their cost is part of ``blocked_s``."""
        return self.stats.eager

    # --- the futures --------------------------------------------------------------------------
    @property
    def capture_future(self) -> concurrent.futures.Future[None]:
        """Resolves (to None) once every tensor byte is copied out; fails with :class:`CheckpointFailed`
        if the checkpoint failed or was skipped before that."""
        return self._capture

    @property
    def durable_future(self) -> concurrent.futures.Future[CheckpointResult]:
        """Resolves to the :class:`CheckpointResult` once committed on the persist tier; fails with
        :class:`CheckpointFailed` if the checkpoint failed or was skipped."""
        return self._durable

    @property
    def tier_futures(self) -> Mapping[str, concurrent.futures.Future[Path | str]]:
        """Per tier this checkpoint is due on, the committed directory there (a bucket's: the ``s3://`` URL
        of its prefix). A flush that fails fails its tier's future with the flush's error, and those of
        the tiers it would have gone on to; a failed checkpoint fails them all."""
        return self._tiers

    # --- the trainer's questions ---------------------------------------------------------------
    @property
    def captured(self) -> bool:
        """True once every tensor byte has been copied out: the state may change from now on."""
        return _succeeded(self._capture) and self.error is None

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Block until capture finished (or the checkpoint failed); False on timeout."""
        return _wait(self._capture, timeout)

    def persisted(self, tier: str | None = None) -> bool:
        """Whether the checkpoint is committed on ``tier`` (on any tier when None)."""
        if tier is None:
            return any(_succeeded(future) for future in self._tiers.values())
        future = self._tiers.get(tier)
        return future is not None and _succeeded(future)

    def done(self) -> bool:
        """Durable, failed or skipped (background flushes may still run: see ``tier_futures``)."""
        return self._durable.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until durable, failed or skipped; False on timeout. Never raises the failure."""
        return _wait(self._durable, timeout)

    def result(self, timeout: float | None = None) -> CheckpointResult:
        """The result once durable; :class:`CheckpointFailed` if it failed or was skipped, TimeoutError
        if it is still in flight after ``timeout`` seconds."""
        self._finished_within(timeout)
        return self._durable.result()

    def exception(self, timeout: float | None = None) -> CheckpointFailed | None:
        """What ``result()`` would raise (None for a durable checkpoint); TimeoutError as ``result()``."""
        self._finished_within(timeout)
        return self.failure

    def add_done_callback(self, fn: Callable[[CheckpointHandle], object]) -> None:
        """Call ``fn(handle)`` once the checkpoint is durable, failed or skipped (at once if it is).

        It runs on the runner's loop thread: keep it short and never block there (waiting on a
        checkpoint, a flush or ``runner.close()`` would wait on the very thread that must finish them).
        """
        self._durable.add_done_callback(lambda _future: fn(self))

    def _finished_within(self, timeout: float | None) -> None:
        if not _wait(self._durable, timeout):
            raise TimeoutError(f"checkpoint step {self.step} not finished after {timeout} s")


def _wait(future: concurrent.futures.Future[Any], timeout: float | None) -> bool:
    done, _ = concurrent.futures.wait([future], timeout)
    return bool(done)


class HandleCompleter:
    """The write side of one :class:`CheckpointHandle`: what the runner and its flusher report through.

    Each outcome resolves its futures once; the attributes a waiter reads (``error``, ``skipped``,
    ``flush_errors``) are set before the future that wakes it. The outcome of the checkpoint itself
    (durable, failed, skipped) also writes the one log record of that checkpoint and is counted
    (``count``: the runner's ``metrics()``) before the handle resolves, so whoever it wakes sees both.
    """

    def __init__(
        self, step: int, tiers: Iterable[str], count: Callable[[CheckpointStats], None] | None = None
    ) -> None:
        """``tiers``: where the checkpoint is due, the persist tier first."""
        self._count = count
        self._capture: concurrent.futures.Future[None] = _running_future()
        self._durable: concurrent.futures.Future[CheckpointResult] = _running_future()
        self._tiers: dict[str, concurrent.futures.Future[Path | str]] = {name: _running_future() for name in tiers}
        self.handle = CheckpointHandle(step, self._capture, self._durable, self._tiers)
        # Trainer threads waiting for the capture, by their start time (see wait_captured).
        self._waiting: dict[object, tuple[float, str]] = {}  # token -> (since, thread)
        self._waits_lock = threading.Lock()
        self._capture.add_done_callback(self._count_waits)

    @property
    def step(self) -> int:
        return self.handle.step

    def snapshotted(self, snapshot: EagerSnapshot) -> None:
        """What was copied on the trainer's thread before checkpoint() returned."""
        self.handle.stats.eager = snapshot

    def blocked(self, seconds: float) -> None:
        """The trainer spent ``seconds`` more on this checkpoint in checkpoint(), up to now."""
        self.handle.stats.blocked_s += seconds
        now = time.monotonic()
        self.handle.stats.timeline.add("trainer blocked: checkpoint()", now - seconds, now)

    def wait_captured(self) -> float:
        """Block the calling (trainer's) thread until the capture resolves; the seconds it waited.

        The wait counts as blocked time by the moment the capture resolves, whichever thread gets
        there first, so the stats the job writes into the manifest after the capture include it.
        """
        started = time.monotonic()
        token = object()
        with self._waits_lock:
            if self._capture.done():
                return 0.0
            self._waiting[token] = (started, threading.current_thread().name)
        with marked("waiting for capture"):  # in a torch profile, beside the step it holds up
            _wait(self._capture, None)
        self._count_waits()
        return time.monotonic() - started

    def _count_waits(self, _future: object = None) -> None:
        """Add the waits of the threads still counted as waiting to the blocked time (and the timeline), as of now."""
        now = time.monotonic()
        with self._waits_lock:
            for started, thread in self._waiting.values():
                self.handle.stats.blocked_s += now - started
                self.handle.stats.timeline.add("trainer blocked: waiting for capture", started, now, thread=thread)
            self._waiting.clear()

    def captured(self) -> None:
        _settle(self._capture, None)

    def durable(self, result: CheckpointResult) -> None:
        """Committed on ``result.tier``, the persist tier."""
        stats = self.handle.stats
        self._record(
            "durable",
            "checkpoint step %d durable on %s: %d bytes in %.3f s (%.2f GB/s), trainer blocked %.1f ms",
            self.step, result.tier, stats.raw_bytes, stats.durable_s, stats.gbps, stats.blocked_s * 1e3,
        )  # fmt: skip
        _settle(self._tiers[result.tier], result.path)
        _settle(self._capture, None)
        _settle(self._durable, result)

    def persisted(self, tier: str, path: Path | str) -> None:
        """A background flush committed (and verified) a copy on ``tier``: its directory, or a bucket's URL."""
        _settle(self._tiers[tier], path)

    def flush_failed(self, tier: str, error: BaseException) -> None:
        self.handle.flush_errors[tier] = error
        _fail(self._tiers[tier], error)

    def failed(self, error: BaseException, describing: bool = False) -> None:
        """Failed: ``describing``, on the trainer's thread while the state was listed; else in the pipeline."""
        if describing:
            message = "checkpoint step %d failed while describing state: %s"
            self._record("failed", message, self.step, error, error=error)
        else:
            failure = f"{type(error).__name__}: {error}"
            self._record("failed", "checkpoint step %d failed: %s", self.step, failure, error=error)
        self.handle.error = error
        failure = CheckpointFailed(f"checkpoint step {self.step} failed: {error}")
        failure.__cause__ = error
        self._fail_all(failure)

    def skipped(self, previous: int) -> None:
        """Not taken: step ``previous`` was still in flight (``policies.in_flight: skip``)."""
        self._record("skipped", "checkpoint step %d skipped: step %d still in flight", self.step, previous)
        self.handle.skipped = True
        reason = f"checkpoint step {self.step} was skipped: the previous one was still in flight"
        self._fail_all(CheckpointFailed(reason))

    def _record(self, outcome: Outcome, message: str, *args: object, error: BaseException | None = None) -> None:
        """The one log record of this checkpoint, its stats attached as ``record.tierstate`` (with ``error``
        for a failed one), and its count."""
        stats = self.handle.stats
        stats.outcome = outcome
        if self._count is not None:
            self._count(stats)
        record = stats.as_dict()
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}"
        level = {"durable": logging.INFO, "skipped": logging.WARNING}.get(outcome, logging.ERROR)
        log.log(level, message, *args, extra={"tierstate": record})

    def _fail_all(self, failure: CheckpointFailed) -> None:
        if not self._durable.done():  # what the durable future will raise
            self.handle.failure = failure
        for future in (*self._tiers.values(), self._capture, self._durable):
            _fail(future, failure)


def _settle(future: concurrent.futures.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: concurrent.futures.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def first_leaf(error: BaseException) -> BaseException:
    """TaskGroups wrap failures in ExceptionGroups; the user wants the one that started it."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


async def settled(handle: CheckpointHandle) -> None:
    """Wait until ``handle`` is durable, failed or skipped, whichever; its outcome is its owner's to read."""
    with contextlib.suppress(CheckpointFailed):
        await asyncio.wrap_future(handle.durable_future)
