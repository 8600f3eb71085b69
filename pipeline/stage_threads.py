"""Stage workers as threads joined by bounded hand-offs: a checkpoint's units never cross the event loop.

The YAML chain (capture -> serialize -> [compress ->] persist) keeps its meaning: each stage runs
``workers`` workers that take units from a queue bounded by the stage's ``queue``, and the host cache
bounds what is in flight. A unit goes from one stage's thread straight to the next stage's thread,
never through the asyncio loop: a hand-over through the loop (an executor round trip, a queue, a
task switch) wakes the loop thread, which must take the GIL from the trainer. Measured on a
Python-bound trainer on 2 cores: ~2 ms of the trainer's step time per 16 MiB chunk through the loop,
~0.5 ms between threads (fitted over chunk sizes; a bare hand-over between two threads costs ~60 us
in a microbenchmark; DESIGN.md, "Units between threads"). The loop still runs what happens once
per checkpoint (the plan, opening, the commit) and awaits the whole flow as one call.

A failure anywhere stops the flow: every wait (a full or empty queue, a full host cache, a retry's
backoff, persist's pacing) ends, each worker returns after the call it is in, and the first error is
the one raised. Cancelling the awaiting task stops the flow the same way and still waits for the
threads, so no slab is released while a thread writes into it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from tierstate.errors import TierstateError


class Stopped(TierstateError):
    """Raised in a worker whose flow stopped (another worker failed, or the job was cancelled); it
    unwinds that worker and never leaves ``run_workers``, which raises the stop's first cause instead."""


class Flow:
    """What every worker of one checkpoint's flow shares: one lock, the stop and its first cause."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self._slept = threading.Condition(self.lock)  # what sleep waits on
        self._waits: list[threading.Condition] = [self._slept]  # every wait stop must end: sleep's, the queues'
        self._on_stop: list[Callable[[], None]] = []

    def condition(self) -> threading.Condition:
        """A condition on the flow's lock that :meth:`stop` wakes."""
        condition = threading.Condition(self.lock)
        self._waits.append(condition)
        return condition

    def on_stop(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` when the flow stops: it must end a wait on another lock (the host cache's)."""
        self._on_stop.append(wake)

    def stop(self, error: BaseException) -> None:
        """Stop every worker; the first ``error`` is the flow's."""
        with self.lock:
            if self.stopped.is_set():
                return
            self.error = error
            self.stopped.set()
            for condition in self._waits:
                condition.notify_all()
        for wake in self._on_stop:
            wake()

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a retry's backoff, persist's pacing); raises Stopped as soon as the flow stops."""
        with self.lock:
            if self._slept.wait_for(self.stopped.is_set, seconds):
                raise Stopped


class Handoff:
    """A bounded FIFO from one stage's workers to the next stage's; closed by the last worker before it."""

    def __init__(self, bound: int, flow: Flow) -> None:
        self.bound = bound
        self.peak = 0
        self._flow = flow
        self._units: collections.deque[Any] = collections.deque()
        self._closed = False
        self._not_empty = flow.condition()
        self._not_full = flow.condition()

    def put(self, unit: Any) -> None:
        with self._flow.lock:
            while len(self._units) >= self.bound and not self._flow.stopped.is_set():
                self._not_full.wait()
            if self._flow.stopped.is_set():
                raise Stopped
            self._units.append(unit)
            self.peak = max(self.peak, len(self._units))
            self._not_empty.notify()

    def get(self) -> Any | None:
        """The next unit; None once the queue is closed and empty."""
        with self._flow.lock:
            while not self._units and not self._closed and not self._flow.stopped.is_set():
                self._not_empty.wait()
            if self._flow.stopped.is_set():
                raise Stopped
            if not self._units:
                return None
            self._not_full.notify()
            return self._units.popleft()

    def close(self) -> None:
        with self._flow.lock:
            self._closed = True
            self._not_empty.notify_all()


async def run_workers(flow: Flow, calls: list[tuple[concurrent.futures.Executor, Callable[..., None], tuple]]) -> None:
    """Run every ``(pool, fn, args)`` as one thread of the flow until all return; raise the flow's first error.

    A worker's exception stops the flow (the others return at their next wait). Cancelled, this stops
    the flow too and still waits for every thread before it unwinds. Only the last worker to return wakes
    the loop: a future per worker woke it once each (a checkpoint runs 5-7 of them), and each wake-up is a
    thread taking the GIL from the trainer (the module docstring).
    """
    if not calls:
        return  # no worker would ever resolve the wait below
    loop = asyncio.get_running_loop()
    all_returned = loop.create_future()
    left = [len(calls)]

    def returned() -> None:
        with flow.lock:
            left[0] -= 1
            last = left[0] == 0
        if last and not loop.is_closed():  # closed: nobody awaits the flow any more (a runner torn down)
            loop.call_soon_threadsafe(_resolve, all_returned)

    for i, (pool, fn, args) in enumerate(calls):
        try:
            pool.submit(_worker, flow, fn, args, returned)
        except BaseException as exc:  # a pool shut down: the workers already started stop at their next wait
            flow.stop(exc)
            for _ in calls[i:]:
                returned()
            break
    try:
        await asyncio.shield(all_returned)
    except asyncio.CancelledError:
        flow.stop(asyncio.CancelledError())
        await all_returned
        raise
    if flow.error is not None:
        raise flow.error


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _worker(flow: Flow, fn: Callable[..., None], args: tuple, returned: Callable[[], None]) -> None:
    try:
        fn(*args)
    except Stopped:
        pass
    except BaseException as exc:  # reported once, as the flow's error, by run_workers
        flow.stop(exc)
    finally:
        returned()
