"""The handle ``runner.checkpoint(step)`` returns at once, and what it reports later.

It is the trainer's only view of a checkpoint in flight: whether its tensors are captured (so the
optimizer may step), on which tiers it is durable, how long it blocked training, and, if it
failed, why. A failure is reported here and in the log; it is never raised into the training loop
unless the trainer asks for ``result()``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from tierstate.errors import TierstateError


class CheckpointFailed(TierstateError, RuntimeError):
    """Raised by ``result()`` for a checkpoint that failed or was skipped."""


@dataclass(frozen=True)
class CheckpointResult:
    step: int
    tier: str
    path: Path
    raw_bytes: int
    stored_bytes: int
    capture_s: float
    durable_s: float


class CheckpointHandle:
    def __init__(self, step: int) -> None:
        self.step = step
        # Seconds the trainer spent in checkpoint() plus in the step pre-hook waiting for this capture.
        # Kept here, not in the result: the pre-hook may still add to it after the result exists.
        self.blocked_s = 0.0
        self.skipped = False
        self.error: BaseException | None = None
        self._captured = threading.Event()
        self._done = threading.Event()
        self._tiers: dict[str, Path] = {}
        self._result: CheckpointResult | None = None
        # Background flushes to slower tiers that failed (tier -> error); the checkpoint itself is fine.
        self.flush_errors: dict[str, BaseException] = {}

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "failed" if self.error else "durable" if self._result else "in flight"
        return f"<CheckpointHandle step={self.step} {state}>"

    @property
    def captured(self) -> bool:
        """True once every tensor byte has been copied out: the state may change from now on."""
        return self._captured.is_set() and self.error is None

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Block until capture finished (or the checkpoint failed); False on timeout."""
        return self._captured.wait(timeout)

    def persisted(self, tier: str | None = None) -> bool:
        """Whether the checkpoint is committed on ``tier`` (on any tier when None)."""
        return bool(self._tiers) if tier is None else tier in self._tiers

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until durable, failed or skipped; False on timeout. Never raises the failure."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> CheckpointResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint step {self.step} not finished after {timeout} s")
        if self.skipped:
            raise CheckpointFailed(f"checkpoint step {self.step} was skipped: the previous one was still in flight")
        if self.error is not None:
            raise CheckpointFailed(f"checkpoint step {self.step} failed: {self.error}") from self.error
        assert self._result is not None
        return self._result

    # Called by the runner, from its loop thread.
    def _set_captured(self) -> None:
        self._captured.set()

    def _set_durable(self, result: CheckpointResult) -> None:
        self._tiers[result.tier] = result.path
        self._result = result
        self._captured.set()
        self._done.set()

    def _set_persisted(self, tier: str, path: Path) -> None:
        """A background flush committed (and verified) a copy on ``tier``."""
        self._tiers[tier] = path

    def _set_flush_failed(self, tier: str, error: BaseException) -> None:
        self.flush_errors[tier] = error

    def _set_failed(self, error: BaseException) -> None:
        self.error = error
        self._captured.set()
        self._done.set()

    def _set_skipped(self) -> None:
        self.skipped = True
        self._captured.set()
        self._done.set()
