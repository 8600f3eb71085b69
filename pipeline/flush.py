"""Background flush and retention: after each commit, copy the checkpoint on and prune the tiers.

Once a checkpoint commits on the persist tier (NVMe), it goes on along the flush graph (tiers/ops/due.py):
every tier whose ``flush`` comes from the persist tier and selects its step (the PFS, a bucket) gets a
copy, and once published there, every tier whose flush comes from that one (``from: pfs``), and so on.
A copy is :func:`tiers.ops.transfer.transfer`, the same code as ``tierstate migrate``: to a directory frame
by frame, every checksum verified on the target, published with the commit protocol; to a bucket
verified in the source, uploaded, the manifest last with a conditional put. Once published, its
receipt goes into every local copy of the step, and the handle's future of that tier resolves.
Copies run on the runner's loop as tasks, at most ``flush.workers`` per target tier at a time, paced
to ``flush.bandwidth`` bytes/s shared by them, in a thread pool of their own so they never hold up
the next checkpoint's writes. After each commit and each flush, retention
(:func:`tiers.ops.retention.prune`) applies every tier's ``retention`` policy (a bucket's own after a
flush to it); it never deletes the copy that feeds a tier the checkpoint is still due on, so a
pending or failed flush keeps its NVMe copy.

With many ranks and a node-scoped persist tier (each node its own NVMe), every node's leader copies
its node's part; the global checkpoint appears on the shared tier once the last part is there
(:mod:`tiers.storage.nodeparts`), and every rank waits for that before its handle says ``persisted``.

A copy that fails with a transient error (EIO, ENOSPC, a timeout) is tried again, ``flush.retries``
times, after ``flush.backoff`` seconds and twice as long each next time; being resumable, a retry
copies only what is missing. A flush that still fails, like a failed checkpoint, never reaches the
training loop: it is logged, recorded on the handle (``flush_errors``, and its tier's future) and
in ``failures``, each saying that its source copy stays pinned (retention keeps it until the
tier receives it); ``drain`` (called by ``runner.close()``) waits for every flush and reports them all.
A flush that fails because its source copy is damaged (confirmed by a verification) is noted
unflushable instead (:mod:`tiers.ops.pending`): reported once, and retention may then free that copy.

A runner that starts on tiers where a crash left committed steps due on a later tier and not there
resumes those flushes (``resume``, called once by the runner): in the background, oldest first, each
from the copy nearest its target, through the same gates, pacing, retries and verification as any
flush, while it holds each source tier's writer lock, so that a second process started on the same
tiers leaves them to this one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierstate.errors import TierstateError

from ..tiers.ops.migrate import MigrateReport
from ..tiers.ops.pacing import Pacer
from ..tiers.ops.pending import PendingFlush, give_up_if_damaged, note_received, pending_flushes
from ..tiers.ops.policy import FlushEdge
from ..tiers.ops.retention import BucketPolicies, TierPolicies, collect_garbage, prune, prune_bucket
from ..tiers.ops.transfer import transfer
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.locks import InUseError, claim_tier
from ..tiers.storage.s3tier import S3Tier
from ..tiers.storage.tier import Tier
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
    def of(
        cls, config: PipelineConfig, group: CheckpointGroup | None, wait_s: float, agent: bool = False
    ) -> FlushRole:
        """``wait_s``: how long a rank that does not copy waits for a copy to appear (the group timeout).
        With a node agent running (``agent``, pipeline/agent.py) no rank copies: each waits for the agent's."""
        if group is None:
            return cls(copies=not agent, wait_s=wait_s if agent else 0.0)
        if config.tiers[config.persist_tier].scope == "shared":
            return cls(active=group.is_leader, copies=not agent, wait_s=wait_s if agent else 0.0)
        node_tiers = frozenset(name for name, tier in config.tiers.items() if tier.scope == "node")
        prunes = None if group.is_leader else node_tiers if group.is_node_leader else frozenset()
        return cls(copies=group.is_node_leader and not agent, prunes=prunes, wait_s=wait_s)


@dataclass(frozen=True)
class FlushFailure:
    """A flush that failed for good, and the source copy it leaves pinned."""

    step: int
    tier: str
    error: BaseException
    attempts: int = 1
    source: str = ""
    damaged: str | None = None  # the source copy is damaged (the first problem): noted unflushable, not pinned

    def __str__(self) -> str:
        tries = f" after {self.attempts} attempts" if self.attempts > 1 else ""
        text = f"flush of step {self.step} to tier {self.tier} failed{tries}: {type(self.error).__name__}: {self.error}"
        if self.damaged is not None:
            text += (
                f"; its copy on {self.source} is damaged ({self.damaged}), so it can never be flushed: "
                f"not tried again, and retention on {self.source} may delete it by its rule"
            )
        elif self.source:
            text += (
                f"; its copy on {self.source} stays pinned (retention keeps it) until {self.tier} receives it"
                f" (tierstate migrate {self.step} --from {self.source} --to {self.tier})"
            )
        return text


@dataclass
class _Target:
    """A tier flushed to (a directory or a bucket), the edge that feeds it, its gate and pacer."""

    tier: Tier
    edge: FlushEdge
    gate: asyncio.Semaphore
    pacer: Pacer


class Flusher:
    """The runner's background flushes and retention; all methods but ``drain`` run on its loop."""

    def __init__(
        self,
        config: PipelineConfig,
        tiers: list[FilesystemTier],
        buckets: Sequence[S3Tier],
        loop: asyncio.AbstractEventLoop,
        role: FlushRole = FlushRole(),
    ) -> None:
        self._role = role
        self._active = role.active
        self._loop = loop
        self._tiers = tiers
        by_name: dict[str, Tier] = {t.name: t for t in [*tiers, *buckets]}
        self._source = next(t for t in tiers if t.name == config.persist_tier)
        self._policies = [TierPolicies(t, config.tiers[t.name].retention, config.tiers[t.name].flush) for t in tiers]
        self._buckets = [BucketPolicies(b, config.buckets[b.name].retention) for b in buckets]
        self._graph = config.flush_graph()
        self._targets = {
            edge.target: _Target(by_name[edge.target], edge, asyncio.Semaphore(edge.policy.workers),
                                 Pacer(edge.policy.bandwidth))
            for edge in self._graph.edges
        }  # fmt: skip
        self._prunes = role.prunes != frozenset() and any(p.retention.active for p in self._policies)
        self._align = int(config.align)
        workers = sum(t.edge.policy.workers for t in self._targets.values()) + 1  # + 1: retention beside the copies
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tierstate-flush")
        self._tasks: set[asyncio.Task[object]] = set()
        self._prune_lock = asyncio.Lock()
        self._resumed: asyncio.Task[object] | None = None
        self.failures: list[FlushFailure] = []

    def due(self, step: int) -> list[str]:
        """The tiers this flusher will copy ``step`` to once it commits, along the flush graph (none on a
        rank that does not commit)."""
        return self._graph.reached(self._source.name, step) if self._active else []

    def committed(self, completer: HandleCompleter) -> None:
        """``completer``'s checkpoint just committed on the persist tier: start its flushes, then prune."""
        if not self._active:
            return
        self._onwards(completer.step, self._source, completer)
        if self._prunes:
            self._spawn(self._prune())

    def _onwards(self, step: int, holder: Tier, completer: HandleCompleter) -> None:
        """``step`` is now on ``holder``: start the flushes of the edges out of it that select the step (a
        bucket is the last hop: the config refuses a flush from one)."""
        source = holder.as_directory()
        for edge in self._graph.edges_from(holder.name):
            if edge.policy.due(step) and source is not None:
                self._spawn(self._flush(step, self._targets[edge.target], source, completer))

    def _spawn(self, work: Coroutine[Any, Any, object]) -> asyncio.Task[object]:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _flush(
        self, step: int, target: _Target, source: FilesystemTier, completer: HandleCompleter | None
    ) -> None:
        """Copy ``step`` from ``source`` to ``target`` (retried, reported), then on to the tiers after it;
        ``completer``: its handle, None for a step a crashed run left (:meth:`resume`), whose flush nobody
        waits on and whose later hops are pending flushes of their own."""
        name = target.tier.name
        report = None
        attempts = 0
        if self._role.copies:
            retry = RetryPolicy(target.edge.policy.retries, target.edge.policy.backoff)
            while True:
                attempts += 1
                try:
                    report = await self._copy(step, target, source)
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
                    await self._failed(step, completer, name, source, exc, attempts)
                    return
            log.info("step %d flushed to %s: %d bytes in %.3f s", step, name, report.bytes_copied, report.seconds)
        if completer is None:  # a step a crashed run left: its other nodes' parts come as their runners resume
            if report is not None and not report.waiting_for:
                await self._received(step, target, source)
            await self._pruned_after(target)
            return
        if self._role.wait_s and (report is None or report.waiting_for):
            try:
                await self._published(step, target.tier, report)
            except Exception as exc:  # reported, never raised into training
                await self._failed(step, completer, name, source, exc, max(attempts, 1))
                return
        if report is not None:
            await self._received(step, target, source)
        copy = target.tier.as_directory()  # its directory there, or a bucket's prefix (named by its s3:// URL)
        completer.persisted(name, copy.step_dir(step) if copy is not None else target.tier.where(step))
        self._onwards(step, target.tier, completer)
        await self._pruned_after(target)

    async def _copy(self, step: int, target: _Target, source: FilesystemTier) -> MigrateReport:
        """One attempt at copying ``step`` to ``target``, as one of its ``workers``."""
        async with target.gate:
            copy = functools.partial(transfer, align=self._align, pacer=target.pacer)
            return await run_blocking(self._pool, copy, step, source, target.tier)

    async def _received(self, step: int, target: _Target, source: FilesystemTier) -> None:
        """``target`` published ``step`` (the whole checkpoint, not only this node's part): its receipt goes
        into every local copy of the step upstream of it (tiers/ops/due.py)."""
        received = functools.partial(note_received, graph=self._graph)
        await run_blocking(self._pool, received, self._tiers, step, target.tier.name, source)

    async def _pruned_after(self, target: _Target) -> None:
        """Retention after a flush: on the local tiers, and on ``target`` if it is a bucket (its own rule)."""
        if self._prunes:
            await self._prune()
        bucket = next((b for b in self._buckets if b.tier is target.tier and b.retention.active), None)
        if bucket is not None and self._role.prunes is None:  # the job's leader, or a process on its own
            try:
                await run_blocking(self._pool, prune_bucket, bucket, False)
            except Exception as exc:  # reported, never raised into training
                log.error("retention on bucket %s failed: %s: %s", bucket.tier.name, type(exc).__name__, exc)

    async def _failed(
        self,
        step: int,
        completer: HandleCompleter | None,
        name: str,
        source: FilesystemTier,
        exc: BaseException,
        attempts: int,
    ) -> None:
        """Report a flush that failed for good: in the log, on its handle and in ``failures``. If its
        source copy is damaged it is noted unflushable, and retention may free it now."""
        damaged = None
        if self._role.copies:
            damaged = await run_blocking(self._pool, give_up_if_damaged, source, step, name, exc)
        failure = FlushFailure(step, name, exc, attempts, source.name, damaged)
        log.error("%s", failure)
        if completer is not None:
            completer.flush_failed(name, exc)
            for later in self._graph.reached(name, step):  # never reached from here now
                completer.flush_failed(later, exc)
        self.failures.append(failure)
        if damaged is not None and self._prunes:
            await self._prune()

    def resume(self) -> None:
        """Start the flushes a crashed run left undone (see the module docstring), in the background.

        Called by the runner before its first checkpoint: the steps listed here are a previous run's,
        never one this runner commits (and flushes) itself."""
        if not (self._active and self._role.copies and self._targets):
            return
        try:
            left = self._pending()
        except Exception as exc:  # reported, never raised into training
            log.error("could not look for flushes left pending on %s: %s: %s", self._source.name,
                      type(exc).__name__, exc)  # fmt: skip
            return
        if left:
            self._collect_dead_partials()
            self._resumed = self._spawn(self._resume({(p.step, name) for p in left for name in p.targets}))

    def wait_resumed(self) -> None:
        """From any thread but the loop's: wait until the flushes :meth:`resume` started are done (at once if
        none): the peer copies a crashed run left (pipeline/peers.py) include steps these flushes bring."""
        if self._resumed is not None:
            resumed = self._resumed
            asyncio.run_coroutine_threadsafe(asyncio.wait([resumed]), self._loop).result()

    def _collect_dead_partials(self) -> None:
        """A dead writer's partials would take room on a bounded tier: removed here, on the trainer's thread,
        before the runner's first checkpoint (in the background, its removal of a dead ``step-N.partial``
        held that partial while this runner began step N again, and that checkpoint failed as in use)."""
        try:
            claim = claim_tier(self._source.root, self._source.owner)
        except InUseError as exc:  # another process writes the source tier: its partials are its own
            log.info("partials on tier %s left to its writer: %s", self._source.name, exc)
            return
        try:
            collect_garbage([self._source], 0.0)  # this process's own partials are locked, so kept
        except Exception as exc:  # reported, never raised into training
            log.error("could not remove the partials a crash left on %s: %s: %s", self._source.name,
                      type(exc).__name__, exc)  # fmt: skip
        finally:
            claim.release()

    def _pending(self) -> list[PendingFlush]:
        """The steps some tier of the flush graph is due to receive and lacks, each from the copy nearest it."""
        return pending_flushes(self._policies, graph=self._graph)

    async def _resume(self, left: set[tuple[int, str]]) -> None:
        """Hold each source tier's writer lock, then flush what is still pending of ``left``, oldest first."""
        claims = []
        try:
            # Another process may have flushed some meanwhile (before this one held the locks): looked at again.
            pending = await run_blocking(self._pool, self._pending)
            flushes = []
            held = set()
            for source in {p.source.name: p.source for p in pending}.values():
                try:
                    claims.append(await run_blocking(self._pool, claim_tier, source.root, source.owner))
                    held.add(source.name)
                except InUseError as exc:  # another process writes that tier: its runner flushes from it
                    log.info("flushes pending on tier %s left to its writer: %s", source.name, exc)
            for item in pending:  # oldest first; each target's gate lets them through in this order
                names = [name for name in item.targets if (item.step, name) in left]
                if not names or item.source.name not in held:
                    continue
                log.info("step %d on %s is due on %s and not there: resuming its flush", item.step,
                         item.source.name, ", ".join(names))  # fmt: skip
                flushes += [self._spawn(self._flush(item.step, self._targets[n], item.source, None)) for n in names]
            await asyncio.gather(*flushes, return_exceptions=True)
        except Exception as exc:  # reported, never raised into training
            log.error("resuming the flushes pending on %s failed: %s: %s", self._source.name,
                      type(exc).__name__, exc)  # fmt: skip
        finally:
            for claim in claims:
                claim.release()

    async def _published(self, step: int, tier: Tier, report: MigrateReport | None) -> None:
        """Wait until the other nodes' parts complete ``step`` on ``tier`` (see :class:`FlushRole`)."""
        deadline = self._loop.time() + self._role.wait_s
        pause = 0.02
        while not await run_blocking(self._pool, tier.holds, step):
            if self._loop.time() >= deadline:
                if report is None:
                    missing = "the copy another process makes (the node agent's, or another node's leader's)"
                else:  # as this node's copy found them
                    missing = f"the part(s) of node(s) {', '.join(report.waiting_for)}, as this node's copy found"
                    missing = f"{missing} ({report.outcome})"
                raise PartsMissing(
                    f"step {step} is not on tier {tier.name} ({tier.where(step)}) after {self._role.wait_s:g} s: "
                    f"still missing {missing}"
                )
            await asyncio.sleep(pause)  # another node's copy ends on its own schedule: nothing to wait on here
            pause = min(1.0, pause * 2)

    async def _prune(self) -> bool:
        """One retention pass over the tiers this rank prunes; whether it deleted anything."""
        async with self._prune_lock:  # one pass at a time: each sees the deletions of the one before
            try:
                prune_all = functools.partial(prune, only=self._role.prunes, graph=self._graph)
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
