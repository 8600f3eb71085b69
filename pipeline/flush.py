"""Background flush and retention: after each commit, copy the checkpoint on and prune the tiers.

Once a checkpoint commits on the persist tier (NVMe), every tier whose ``flush`` policy selects
its step (the PFS) gets a copy by :func:`tiers.migrate.migrate`, the same code as ``tierstate
migrate``: frame by frame, every checksum verified on the target, published with the commit
protocol. Copies run on the runner's loop as tasks, at most ``flush.workers`` per target tier at a
time, paced to ``flush.bandwidth`` bytes/s shared by them, in a thread pool of their own so they
never hold up the next checkpoint's writes. After each commit and each flush, retention
(:func:`tiers.retention.prune`) applies every tier's ``retention`` policy; it never deletes a
checkpoint still due on a flush tier, so a pending or failed flush keeps its NVMe copy.

With many ranks and a node-scoped persist tier (each node its own NVMe), every node's leader copies
its node's part; the global checkpoint appears on the shared tier once the last part is there
(:mod:`tiers.nodeparts`), and every rank waits for that before its handle says ``persisted``.

A copy that fails with a transient error (EIO, ENOSPC, a timeout) is tried again, ``flush.retries``
times, after ``flush.backoff`` seconds and twice as long each next time; being resumable, a retry
copies only what is missing. A flush that still fails, like a failed checkpoint, never reaches the
training loop: it is logged, recorded on the handle (``flush_errors``, and its tier's future) and
in ``failures``, each saying that its source copy stays pinned (retention keeps it until the
tier receives it); ``drain`` (called by ``runner.close()``) waits for every flush and reports them all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierstate.errors import TierstateError

from ..tiers.filesystem import FilesystemTier
from ..tiers.migrate import MigrateReport, migrate
from ..tiers.nodeparts import parts_present
from ..tiers.pacing import Pacer
from ..tiers.policy import FlushPolicy
from ..tiers.retention import TierPolicies, prune
from .config import PipelineConfig
from .handle import HandleCompleter
from .retry import RetryPolicy, transient
from .units import run_blocking

if TYPE_CHECKING:
    from .distributed import CheckpointGroup

log = logging.getLogger("tierstate")


class PartsMissing(TierstateError, TimeoutError):
    """A node's part is on the shared tier, but other nodes' parts did not arrive in time; names them."""


@dataclass(frozen=True)
class FlushRole:
    """What one rank's flusher does: everything (one process), nothing (the non-committing ranks of a
    shared persist tier), or, on a node-scoped persist tier, copy its node's part (the node's leader),
    wait for the global checkpoint (every rank, up to ``wait_s``) and prune the tiers in ``prunes``."""

    active: bool = True
    copies: bool = True
    prunes: frozenset[str] | None = None  # the tiers retention may delete from; None: all of them
    wait_s: float = 0.0  # > 0: the global checkpoint is published by whichever node finishes last

    @classmethod
    def of(cls, config: PipelineConfig, group: CheckpointGroup | None, wait_s: float) -> FlushRole:
        if group is None:
            return cls()
        if config.tiers[config.persist_tier].scope == "shared":
            return cls(active=group.is_leader)
        node_tiers = frozenset(name for name, tier in config.tiers.items() if tier.scope == "node")
        prunes = None if group.is_leader else node_tiers if group.is_node_leader else frozenset()
        return cls(copies=group.is_node_leader, prunes=prunes, wait_s=wait_s)


@dataclass(frozen=True)
class FlushFailure:
    """A flush that failed for good, and the source copy it leaves pinned."""

    step: int
    tier: str
    error: BaseException
    attempts: int = 1
    source: str = ""

    def __str__(self) -> str:
        tries = f" after {self.attempts} attempts" if self.attempts > 1 else ""
        text = f"flush of step {self.step} to tier {self.tier} failed{tries}: {type(self.error).__name__}: {self.error}"
        if self.source:
            text += (
                f"; its copy on {self.source} stays pinned (retention keeps it) until {self.tier} receives it"
                f" (tierstate migrate {self.step} --from {self.source} --to {self.tier})"
            )
        return text


@dataclass
class _Target:
    tier: FilesystemTier
    policy: FlushPolicy
    gate: asyncio.Semaphore
    pacer: Pacer
    active: int = 0
    peak: int = 0  # most copies to this tier that ran at once


class Flusher:
    """The runner's background flushes and retention; all methods but ``drain`` run on its loop."""

    def __init__(
        self,
        config: PipelineConfig,
        tiers: list[FilesystemTier],
        loop: asyncio.AbstractEventLoop,
        role: FlushRole = FlushRole(),
    ) -> None:
        self._role = role
        self._active = role.active
        by_name = {tier.name: tier for tier in tiers}
        self._loop = loop
        self._source = by_name[config.persist_tier]
        self._policies = [TierPolicies(by_name[name], t.retention, t.flush) for name, t in config.tiers.items()]
        self._targets = [
            _Target(by_name[name], t.flush, asyncio.Semaphore(t.flush.workers), Pacer(t.flush.bandwidth))
            for name, t in config.tiers.items()
            if t.flush is not None
        ]
        self._prunes = role.prunes != frozenset() and any(p.retention.active for p in self._policies)
        self._align = int(config.align)
        workers = sum(t.policy.workers for t in self._targets) + 1  # + 1: retention runs beside the copies
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tierstate-flush")
        self._tasks: set[asyncio.Task[object]] = set()
        self._prune_lock = asyncio.Lock()
        self.failures: list[FlushFailure] = []

    @property
    def peaks(self) -> dict[str, int]:
        """Per target tier, the most flushes that ran at once (never above its ``workers``)."""
        return {t.tier.name: t.peak for t in self._targets}

    def due(self, step: int) -> list[str]:
        """The tiers this flusher will copy ``step`` to once it commits (none on a rank that does not commit)."""
        return [target.tier.name for target in self._due_targets(step)]

    def _due_targets(self, step: int) -> list[_Target]:
        if not self._active:
            return []
        return [target for target in self._targets if target.policy.due(step)]

    def committed(self, completer: HandleCompleter) -> None:
        """``completer``'s checkpoint just committed on the persist tier: start its flushes, then prune."""
        if not self._active:
            return
        for target in self._due_targets(completer.step):
            self._spawn(self._flush(completer, target))
        if self._prunes:
            self._spawn(self._prune())

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self, completer: HandleCompleter, target: _Target) -> None:
        step, name = completer.step, target.tier.name
        report = None
        attempts = 0
        if self._role.copies:
            retry = RetryPolicy(target.policy.retries, target.policy.backoff)
            while True:
                attempts += 1
                try:
                    report = await self._copy(step, target)
                    break
                except Exception as exc:  # reported, never raised into training
                    if transient(exc) and attempts <= retry.retries:
                        delay = retry.delay(attempts - 1)
                        log.warning(
                            "flush of step %d to tier %s failed (%s: %s); retry %d of %d in %.2f s",
                            *(step, name, type(exc).__name__, exc, attempts, retry.retries, delay),
                        )
                        await asyncio.sleep(delay)
                        continue
                    self._failed(completer, name, exc, attempts)
                    return
            log.info("step %d flushed to %s: %d bytes in %.3f s", step, name, report.bytes_copied, report.seconds)
        if self._role.wait_s and (report is None or report.waiting_for):
            try:
                await self._published(step, target.tier, report)
            except Exception as exc:  # reported, never raised into training
                self._failed(completer, name, exc, max(attempts, 1))
                return
        completer.persisted(name, target.tier.step_dir(step))
        if self._prunes:
            await self._prune()

    async def _copy(self, step: int, target: _Target) -> MigrateReport:
        """One attempt at copying ``step`` to ``target``, as one of its ``workers``."""
        async with target.gate:
            target.active += 1
            target.peak = max(target.peak, target.active)
            try:
                copy = functools.partial(migrate, align=self._align, pacer=target.pacer)
                return await run_blocking(self._pool, copy, step, self._source, target.tier)
            finally:
                target.active -= 1

    def _failed(self, completer: HandleCompleter, name: str, exc: BaseException, attempts: int) -> None:
        failure = FlushFailure(completer.step, name, exc, attempts, self._source.name)
        log.error("%s", failure)
        completer.flush_failed(name, exc)
        self.failures.append(failure)

    async def _published(self, step: int, tier: FilesystemTier, report: MigrateReport | None) -> None:
        """Wait until the other nodes' parts complete ``step`` on ``tier`` (see :class:`FlushRole`)."""
        deadline = self._loop.time() + self._role.wait_s
        pause = 0.02
        while step not in await run_blocking(self._pool, tier.steps):
            if self._loop.time() >= deadline:
                _, missing = await run_blocking(self._pool, parts_present, tier.partial_dir(step), step)
                mine = "" if report is None else f"this node's part is there ({report.outcome}); "
                raise PartsMissing(
                    f"step {step} is not on tier {tier.name} after {self._role.wait_s:g} s: {mine}still missing "
                    f"the part(s) of node(s) {', '.join(missing)} in {tier.partial_dir(step)}"
                )
            await asyncio.sleep(pause)  # another node's copy ends on its own schedule: nothing to wait on here
            pause = min(1.0, pause * 2)

    async def _prune(self) -> bool:
        """One retention pass over the tiers this rank prunes; whether it deleted anything."""
        async with self._prune_lock:  # one pass at a time: each sees the deletions of the one before
            try:
                prune_all = functools.partial(prune, only=self._role.prunes)
                decisions = await run_blocking(self._pool, prune_all, self._policies)
            except Exception as exc:
                log.error("retention failed: %s: %s", type(exc).__name__, exc)
                return False
        for decision in decisions:
            if decision.delete:
                log.info("retention: deleted step %d from %s (%s)", decision.step, decision.tier, decision.reason)
        return any(decision.delete for decision in decisions)

    async def settle(self) -> bool:
        """For a bounded tier that is full (pipeline/room.py): wait until one pending flush or prune is
        done (each flush prunes after it); with none pending, prune once. Whether room may have come free."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), return_when=asyncio.FIRST_COMPLETED)
            return True
        return self._prunes and await self._prune()

    async def _idle(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def drain(self) -> list[FlushFailure]:
        """From any thread but the loop's: wait until every flush and prune is done; the failures."""
        asyncio.run_coroutine_threadsafe(self._idle(), self._loop).result()
        for failure in self.failures:
            log.error("%s", failure)
        return list(self.failures)

    def close(self) -> None:
        self._pool.shutdown()
