"""The one interface every checkpointing method is timed through, and the no-checkpoint baseline."""

from __future__ import annotations

import concurrent.futures
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Record:
    """One checkpoint as a trainer experiences it."""

    step: int
    requested: float  # perf_counter when asked
    blocked_s: float = 0.0  # training time lost to it: the call itself + any wait before optimizer.step
    durable_at: float | None = None  # perf_counter when all bytes were fsync'd and committed

    @property
    def durable_s(self) -> float:
        return (self.durable_at or float("nan")) - self.requested


class Checkpointer:
    """One checkpointing method behind one interface, so the benchmarks treat all of them alike.

    ``save`` is called right after ``optimizer.step()``; ``before_step`` right before the next
    ``optimizer.step()`` (where a lazy or asynchronously staging method must have copied the state);
    ``drain`` waits until everything requested is durable. Times spent in ``save`` and
    ``before_step`` are what training loses; ``records`` holds one :class:`Record` per checkpoint.
    """

    name = "none"
    # The pinned / shared-memory options of DCP only exist with CUDA; subclasses describe their setup.
    setup = ""

    def __init__(self, state: Any, root: Path) -> None:
        self.state = state
        self.root = root
        self.records: list[Record] = []

    def save(self, step: int) -> Record:
        record = Record(step, time.perf_counter())
        self._save(record)
        record.blocked_s += time.perf_counter() - record.requested
        self.records.append(record)
        return record

    def _save(self, record: Record) -> None:
        record.durable_at = time.perf_counter()

    def before_step(self) -> float:
        return 0.0

    def wait_staged(self) -> float:
        """Wait until the state may change again (captured / staged); seconds waited."""
        return self.before_step()

    def drain(self) -> float:
        return 0.0

    def restore(self, step: int) -> None:
        raise NotImplementedError(f"{self.name}: this method cannot restore")

    def stored_bytes(self, step: int) -> int:
        path = self.path(step)
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def clear(self) -> None:
        """Delete this method's checkpoints (between runs; never timed)."""
        self.drain()
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)

    def close(self) -> None:
        self.drain()


class NoCheckpoint(Checkpointer):
    """The baseline a slowdown is measured against: the same loop, no checkpoint."""

    name = "none"

    def save(self, step: int) -> Record:
        return Record(step, time.perf_counter(), 0.0, time.perf_counter())


class BackgroundCheckpointer(Checkpointer):
    """A method whose work goes on after ``save`` returns, tracked by two futures of its latest
    checkpoint: ``staged`` (the state may change again: the trainer waits for it right before the next
    ``optimizer.step()``, and that wait counts as the checkpoint's blocked time) and ``durable``."""

    staged: concurrent.futures.Future[Any] | None = None
    durable: concurrent.futures.Future[Any] | None = None

    @staticmethod
    def _wait(future: concurrent.futures.Future[Any] | None) -> float:
        """Seconds spent waiting for ``future`` (none when it is None or done)."""
        if future is None or future.done():
            return 0.0
        started = time.perf_counter()
        future.result()
        return time.perf_counter() - started

    def before_step(self) -> float:
        waited = self._wait(self.staged)
        if waited and self.records:
            self.records[-1].blocked_s += waited
        return waited

    def drain(self) -> float:
        return self._wait(self.durable)
