"""An average-rate limit shared by concurrent writers: a bandwidth share of a shared disk or PFS."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Pacer:
    """Says how long to wait so that the bytes reported so far stay under ``rate`` bytes per second.

    It only computes the delay; the caller sleeps, with ``time.sleep`` in a worker thread or
    ``asyncio.sleep`` on a loop, so one pacer serves both. Thread-safe, so several copies can share
    one budget. ``rate=None`` never waits.
    """

    def __init__(self, rate: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be a positive number of bytes per second, got {rate}")
        self.rate = rate
        self._clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None
        self._sent = 0

    def delay(self, nbytes: int) -> float:
        """Account for ``nbytes`` just written; the seconds to wait before writing more (>= 0)."""
        if self.rate is None:
            return 0.0
        with self._lock:
            now = self._clock()
            if self._started is None:
                self._started = now
            self._sent += nbytes
            return max(0.0, self._sent / self.rate - (now - self._started))

    def wait(self, nbytes: int) -> None:
        """:meth:`delay`, then sleep it off in this (worker) thread."""
        seconds = self.delay(nbytes)
        if seconds > 0:
            time.sleep(seconds)
