"""The runner embedded in the trainer: ``checkpoint(step)`` returns at once, the pipeline does the rest.

It owns an asyncio loop on a background thread, the host cache and the worker thread pools. On
the trainer's thread ``checkpoint`` only asks the providers to describe their state (objects are
snapshotted, tensors referenced) and hands the plan to the loop; the tensor copies then run while
the next forward/backward runs, and the optimizer step pre-hook installed by ``attach`` waits only
if they are still pending. One checkpoint is in flight at a time; another request meanwhile
follows ``policies.in_flight`` (wait or skip), so nothing queues without bound.

A runner belongs to the process that made it (pipeline/lifecycle.py: drained at exit, disowned in a
forked child). What it hands each committed checkpoint to (flushes, peer copies) is pipeline/aftercommit.py's
protocol; the threads and the cache it runs on, pipeline/engine.py's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..providers.base import OwnsOptimizer
from ..providers.composite import CompositeProvider
from ..providers.items import TensorItem
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.s3tier import S3Tier
from .aftercommit import AfterCommit
from .agent import AgentLink
from .agreement import newest_held, restore_checkpoint
from .buckets import Buckets
from .cadence import cadence_of
from .config import PipelineConfig, load_config, parse_config
from .distributed import DistributedCommit, group_for_runner
from .engine import Engine
from .flush import Flusher, FlushFailure, FlushRole
from .fresh import start_fresh
from .handle import CheckpointHandle, CheckpointResult, HandleCompleter, first_leaf, settled
from .holders import built_at, hold
from .job import CheckpointJob, JobContext
from .laziness import CaptureRules, release_copies, unwrap_optimizer
from .lifecycle import RunnerClosedError, adopt, closed_reason
from .metrics import CheckpointStats, RunMetrics
from .peers import PeerLink
from .plan_cache import PlanCache
from .registration import provider_for
from .request import Request, checked_step, prepare
from .restore import RestoreResult, nearest_first
from .room import Room
from .solo import RestoreGroup, SoloGroup
from .tierpaths import check_tier_paths, warn_unbounded, written_tiers
from .trace import marks
from .units import run_blocking

log = logging.getLogger("tierstate")


class Runner:
    """Checkpoints of a training process's state, taken while it trains: asynchronous, across storage tiers.

    Build one per training process from a pipeline config (``Runner.from_yaml()``: the packaged default,
    tiers under ./checkpoints; ``from_yaml("tiered")`` another packaged one by name; ``from_yaml("my.yaml")``
    a file; ``from_dict({...})`` a mapping), register what to checkpoint, restore on a restart, checkpoint
    as the loop goes, and close it at the end::

        runner = Runner.from_yaml()
        runner.register(model=model, optim=opt, sched=scheduler)   # modules, optimizers, state_dict() owners
        try:
            runner.restore("latest")            # a restart goes on from the newest checkpoint
        except NothingToRestoreError:
            pass                                # a first run
        for step in range(start, steps):
            ...
            handle = runner.checkpoint(step)    # returns at once
        runner.close()                          # every checkpoint durable, or reported failed

    ``checkpoint(step)`` returns at once: the copies of parameters and optimizer state run while the next
    forward/backward does, and a registered (or ``attach``-ed) optimizer's ``step()`` waits only while they
    are pending; a pipeline of threads then writes, checksums and commits the checkpoint on the persist tier,
    and flushes it on to slower tiers in the background. Its handle tells how it went (``handle.result()``
    waits and raises :class:`CheckpointFailed`; ``handle.stats`` what it cost). A checkpoint that fails
    once requested never raises into the training loop: its handle and the ``tierstate`` log say why, and
    the previous checkpoint stays. Mistakes raise where they are made: a config or tier path that cannot
    work when the runner is built, an unusable step (``InvalidStepError``), a step the persist tier holds
    already (``CheckpointExistsError``: restore first) or nothing registered at the call.

    ``restore(which)`` loads a committed checkpoint (``"latest"`` or a step) into the registered state in
    place, from the nearest tier holding a verified copy. With torch.distributed on several ranks every rank
    builds its runner at the same point and the runners commit and restore together.

    One open runner writes a tier in a process: a second one built on a tier this one writes is refused
    (:class:`TierInUseError` naming this one) until this one is closed. A closed runner refuses everything
    (:class:`RunnerClosedError`) but for what the run left: ``metrics()`` (the run summed), ``history`` (the
    latest handles), ``flush_failures`` (the background copies that failed, final after ``close()``) and
    ``steps()``; ``with Runner.from_yaml() as runner:`` closes it at the block's end.
    """

    def __init__(
        self,
        config: PipelineConfig,
        rank: int | None = None,
        *,
        distributed: bool | None = None,
        group_timeout: float = 600.0,
        history_size: int = 64,
    ) -> None:
        """``distributed``: None = across all ranks when torch.distributed runs on several (then every
        rank must build its runner at the same point); ``group_timeout``: seconds a checkpoint
        collective waits for the slowest rank before the checkpoint fails; ``history_size``: how many
        of the latest checkpoints ``history`` keeps (a long run must not keep them all)."""
        self.config = config
        self._closed = False
        self._built = False  # until the end of __init__: a runner whose construction failed holds no tier
        self._built_at = built_at()
        check_tier_paths(config)  # a bad tier path fails here, not at the first checkpoint
        # A second open runner of this process on a tier this one writes fails here, not at its first checkpoint.
        hold(self, [(name, config.tiers[name].path) for name in written_tiers(config)])
        warn_unbounded(config)
        self._group = group_for_runner(distributed, rank, config.policies.in_flight, group_timeout)
        # The ranks of this job, one process a group of one (pipeline/solo.py): one code for any number of ranks.
        self._ranks: RestoreGroup = self._group if self._group is not None else SoloGroup()
        self.rank = self._group.rank if self._group is not None else rank or 0
        self.providers = CompositeProvider()
        # One writer per tier, in a process as across processes: this runner's tiers claim for its own token.
        owner = object()
        self.tiers = [FilesystemTier(name, t.path, t.scope, owner=owner) for name, t in config.tiers.items()]
        self._engine = Engine(config, self.durable_tier, self.rank)
        self.cache = self._engine.cache
        self._rules = CaptureRules()
        # Plans reused while the tensors stay the same (plan_cache.py); with many ranks each rank reuses its
        # own, and the commit takes its share of it per checkpoint (distributed.py, in the background).
        self._plans = PlanCache(self._engine.slab_size)
        self._inflight: HandleCompleter | None = None
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        # The latest checkpoints that reached the pipeline, oldest first, with their stats.
        self.history: collections.deque[tuple[CheckpointHandle, CheckpointStats]] = collections.deque(
            maxlen=history_size
        )
        # Every checkpoint requested, summed (metrics()); added to from the trainer's and the loop's thread.
        self._metrics = RunMetrics()
        self._metrics_lock = threading.Lock()
        # kind: s3 tiers (pipeline/buckets.py), checked here: bad credentials or a missing bucket fail now.
        self._buckets = Buckets(config)
        # Background flushes along the flush graph and retention (pipeline/flush.py), who does what in FlushRole;
        # with agent.enabled a node agent process copies (pipeline/agent.py; None if it cannot run: we copy).
        agent = AgentLink.started(config) if config.agent.enabled else None
        role = FlushRole.of(config, self._group, group_timeout, agent=agent is not None)
        self._flusher = Flusher(config, self.tiers, self._buckets.tiers, self._engine.loop, role)
        self._cadence = cadence_of(config, self._group)
        self._flusher.resume()  # copies a crashed run left due on a later tier go on there, in the background
        self.flush_failures: list[FlushFailure] = []
        # Peer copies of node parts on a partner node (replicas: 1), pipeline/peers.py; collective to build.
        self._peers = PeerLink.of(config, self.tiers, self._group, self._flusher.wait_resumed)
        # Told of each commit, in commit order, then drained and closed in this order (pipeline/aftercommit.py);
        # the agent's link first: a dead agent is started again before a flush waits on it.
        self._after: list[AfterCommit] = [
            *([agent] if agent is not None else []), self._flusher, *([self._peers] if self._peers is not None else [])
        ]
        persist = config.tiers[config.persist_tier]
        self._room = Room.of(self.durable_tier, persist, self._node_ranks(), self._flusher.settle, self._engine.io)
        adopt(self)  # closed at interpreter exit if the trainer forgets, disowned in a forked child
        self._built = True

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        persist = self.config.persist_tier
        return f"<Runner writing {persist} ({self.config.tiers[persist].path}), built at {self._built_at}, {state}>"

    @property
    def closed(self) -> bool:
        """Whether the runner takes no more calls: closed (``close()``, a forked child's copy), or not built."""
        return self._closed or not self._built

    def _refuse_if_closed(self, call: str) -> None:
        if self._closed:
            raise RunnerClosedError(f"runner.{call}: {closed_reason(self._owner_pid)}")

    @classmethod
    def from_yaml(
        cls,
        path: str | os.PathLike[str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        rank: int | None = None,
        **options: Any,
    ) -> Runner:
        """``path``: a YAML file, or a packaged config by name (``tiered``); None = the packaged default."""
        return cls(load_config(path, overrides), rank=rank, **options)

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        overrides: Mapping[str, Any] | None = None,
        rank: int | None = None,
        **options: Any,
    ) -> Runner:
        """The config as a mapping, validated like a YAML file; keys left out take their defaults."""
        return cls(parse_config(data, overrides=overrides), rank=rank, **options)

    # --- wiring -------------------------------------------------------------------------------
    def register(self, **state: Any) -> None:
        """Checkpoint each value under its name: ``register(model=model, optim=opt, sched=scheduler)``.

        An ``nn.Module``, a torch optimizer and anything with ``state_dict()``/``load_state_dict()``
        are wrapped in the provider that fits (pipeline/registration.py); a provider is taken as it
        is. An optimizer, plain or in a provider that owns one (:class:`~providers.base.OwnsOptimizer`, such as
        :class:`OptimizerProvider`), is attached too (see ``attach``).
        Nothing is registered if any value fits no provider.
        """
        self._refuse_if_closed("register()")
        providers = {name: provider_for(name, value) for name, value in state.items()}
        self.providers.add_all(providers)  # a name taken already: ProviderNameError, nothing registered
        for provider in providers.values():
            if isinstance(provider, OwnsOptimizer):
                self.attach(provider.optimizer_to_attach())

    def attach(self, optimizer: torch.optim.Optimizer | Any) -> None:
        """Install the step pre-hook that keeps ``optimizer`` from changing tensors not yet captured.

        From then on its parameters and state are captured lazily, while training goes on (see
        pipeline/laziness.py). A ``load_state_dict`` pre-hook waits the same way: it replaces the state
        tensors, which the plan may take as listed at the request (plan_cache.py). Wrapped optimizers
        (accelerate's, Lightning's) are unwrapped; attaching one optimizer twice installs one of each hook.
        """
        self._refuse_if_closed("attach()")
        self._rules.attach(unwrap_optimizer(optimizer), self._before_step, self._before_load)

    @property
    def attached(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers whose step pre-hook waits for a pending capture."""
        return self._rules.optimizers

    def _before_step(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.wait_captured()

    def _before_load(self, _opt: torch.optim.Optimizer, _state: Any) -> None:
        self.wait_captured()

    @property
    def durable_tier(self) -> FilesystemTier:
        name = self.config.persist_tier
        return next(t for t in self.tiers if t.name == name)

    def _node_ranks(self) -> int:
        """How many ranks write into this node's directory of a node-scoped tier (all: a shared one)."""
        scoped = self.config.tiers[self.config.persist_tier].scope == "node"
        return len(self._ranks.node_ranks) if scoped else self._ranks.world_size

    # --- checkpoint ---------------------------------------------------------------------------
    @marks("checkpoint()")
    def checkpoint(self, step: int) -> CheckpointHandle:
        """Request a checkpoint of the registered state at ``step``; returns without waiting for I/O.

        Raises at once, before anything is written, for a closed runner, a ``step`` that is not a
        whole number from 0 to 2**50, and a runner with nothing registered; any later failure is
        reported on the handle and in the log, never raised here.
        """
        started, requested = time.perf_counter(), time.monotonic()  # the stats' seconds count from the request
        self._refuse_if_closed(f"checkpoint({step!r})")
        step = checked_step(step, self.durable_tier, self._group is not None, bool(self.providers.children))
        durable_on = self._buckets.persist_bucket or self.config.persist_tier  # a bucket, published from its staging
        completer = HandleCompleter(step, [durable_on, *self._flusher.due(step)], self._count)
        handle = completer.handle
        with self._lock:
            previous = self._inflight
            if previous is not None and not previous.handle.done():
                if self.config.policies.in_flight == "skip":
                    completer.blocked(time.perf_counter() - started)
                    completer.skipped(previous.step)
                    return handle
                previous.handle.wait()
            check = self.config.policies.check_capture
            leaves, describe = self.providers.leaves(), self.providers.describe
            try:
                request = prepare(step, leaves, describe, self._plans, self._rules, check, completer.captured)
                completer.snapshotted(request.snapshot)
            except Exception as exc:  # a provider bug must not stop training
                if self._group is None:
                    completer.blocked(time.perf_counter() - started)
                    completer.failed(exc, describing=True)
                    return handle
                log.error("checkpoint step %d failed while describing state: %s", step, exc)
                request = Request.declining(exc, self.cache.slab_size, completer.captured)
            self._inflight = completer
            job = CheckpointJob(
                self._job_context(request.declined), step, request.plan, request.ready, request.on_captured,
                handle.stats, request.sources, requested,
            )  # fmt: skip
            # Counted before the job starts: it writes the blocked time into the manifest.
            completer.blocked(time.perf_counter() - started)
            self._engine.start(self._run(job, completer, request.copies))
        return handle

    def maybe_checkpoint(self, step: int) -> CheckpointHandle | None:
        """Call after every optimizer step: checkpoints ``step`` when ``cadence`` says it is due (every N steps, or
        with ``every: auto`` as often as its measured cost stays within the budget: pipeline/cadence.py), and
        returns its handle; None otherwise. Collective with many ranks where a checkpoint is taken."""
        self._refuse_if_closed(f"maybe_checkpoint({step!r})")
        return self._cadence.maybe(step, self.checkpoint)

    def _job_context(self, declined: BaseException | None) -> JobContext:
        """What a job borrows; with many ranks, the commit among them (``declined``: this rank gives the step up)."""
        node_scoped = self.config.tiers[self.config.persist_tier].scope == "node"
        commit = (
            DistributedCommit(self._group, self.durable_tier, self.cache.slab_size, declined, node_scoped)
            if self._group is not None
            else None
        )
        return JobContext(
            self.config, self.cache, self.durable_tier, self._engine.compute, self._engine.io, self._engine.copier,
            self.rank, commit,
            self._room, self._engine.slots,
        )  # fmt: skip

    def _count(self, stats: CheckpointStats) -> None:
        """A finished checkpoint into ``metrics()`` (from the trainer's thread or the loop's)."""
        with self._metrics_lock:
            self._metrics.add(stats)

    def latest_step(self) -> int | None:
        """The step ``restore("latest")`` would take: the newest every rank holds on some tier (a bucket's
        too); None on a first run. Collective with many ranks (every rank gets the same answer, or the same
        error if a rank could not list a tier: a step left out for that would be a wrong answer)."""
        self._refuse_if_closed("latest_step()")  # collective with many ranks: the closed runner's group is gone
        return newest_held(self._ranks, self.steps)

    async def acheckpoint(self, step: int) -> CheckpointResult:
        """For async trainers: request a checkpoint and await its durability; raises CheckpointFailed.

        No thread is held while it waits, and under ``in_flight: wait`` the previous checkpoint is
        awaited here rather than waited for inside ``checkpoint()``, which would block the event loop.
        """
        self._refuse_if_closed(f"acheckpoint({step!r})")
        if self.config.policies.in_flight == "wait":
            while (previous := self._inflight) is not None and not previous.handle.done():
                await settled(previous.handle)
        handle = self.checkpoint(step)
        return await asyncio.wrap_future(handle.durable_future)

    async def _run(self, job: CheckpointJob, completer: HandleCompleter, copies: list[TensorItem]) -> None:
        try:
            path = await job.run()
            if self._buckets.persist_bucket is not None:  # durable once its manifest is in the bucket
                await run_blocking(self._engine.io, self._buckets.publish, job.step, self.durable_tier, self._group)
        except BaseException as exc:  # report, never raise into training
            release_copies(copies)
            self.history.append((completer.handle, job.stats))
            completer.failed(first_leaf(exc))
            if not isinstance(exc, Exception):
                raise
            return
        release_copies(copies)
        self.history.append((completer.handle, job.stats))
        tier = self._buckets.persist_bucket or self.durable_tier.name
        completer.durable(CheckpointResult.of(job.step, tier, path, job.stats))
        for listener in self._after:
            listener.committed(completer)

    def metrics(self) -> RunMetrics:
        """A summary of every checkpoint requested so far: counts by outcome, bytes, seconds and
        GB/s to durable, blocked time, per-stage totals, and the newest checkpoint's stats."""
        with self._metrics_lock:
            return self._metrics.copy()

    def wait_captured(self) -> float:
        """Block until the pending checkpoint's tensors are copied out; returns the seconds blocked."""
        completer = self._inflight
        return 0.0 if completer is None else completer.wait_captured()

    def wait(self) -> None:
        """Block until the checkpoint in flight (if any) is durable or failed."""
        completer = self._inflight
        if completer is not None:
            completer.handle.wait()

    def start_fresh(self, set_aside: bool = False) -> dict[str, list[int]]:
        """Begin a new run on these tiers (before its first checkpoint; collective with many ranks).

        Tiers holding an earlier run's checkpoints would mix with it (pipeline/fresh.py): this raises
        :class:`ExistingCheckpointsError` naming them, or with ``set_aside=True`` renames them aside
        (kept, never listed or restored); what they held, by tier."""
        self._refuse_if_closed("start_fresh()")
        self.wait()
        return start_fresh(self.tiers, self._buckets.tiers, self._group, self._flusher.drain, set_aside)

    # --- restore ------------------------------------------------------------------------------
    def restore(self, which: int | str = "latest", fallback: bool = False) -> RestoreResult:
        """Load a committed checkpoint into the registered providers, in place; nearest copy first
        (this node's memory and NVMe, then the shared tiers, then a bucket's), falling back on a missing or
        corrupt one.

        ``fallback=True``: if no copy of ``which`` reads clean, take the newest older step that does.
        """
        self._refuse_if_closed(f"restore({which!r})")
        self.wait()
        allow_pickle = self.config.policies.allow_pickle
        returned = None
        if self._peers is not None:  # collective: every rank of a job with peer copies takes part
            returned = self._peers.recall([t for t in self.tiers if t.scope == "node"])
        tiers, buckets = nearest_first(self.tiers, returned), self._buckets.tiers
        return restore_checkpoint(self._ranks, self.providers, tiers, which, allow_pickle, fallback, buckets)

    # --- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Drain: the checkpoint in flight becomes durable or is reported failed, every background flush
        finishes or is reported (``flush_failures``, and each handle's ``flush_errors``); then stop threads.

        In a forked child it returns at once: the runner there is a copy, closed at the fork."""
        if self._closed:
            return
        self._closed = True
        self.wait()
        # Every flush done or reported, then every peer copy (one waits for its tier's flush).
        self.flush_failures = [failure for listener in self._after for failure in listener.drain()]
        self._engine.stop()
        self._rules.detach_all()
        self.durable_tier.release()  # another job may write the tier now
        for listener in self._after:
            listener.close()
        self._ranks.close()

    def disown(self) -> None:
        """In a forked child: the loop thread, the pools and the checkpoint in flight stayed with the parent."""
        self._closed = True
        self._inflight = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def buckets(self) -> list[S3Tier]:
        """The ``kind: s3`` tiers: flushed to, and read when no local tier holds a step."""
        return self._buckets.tiers

    def steps(self) -> dict[str, list[int]]:
        """Committed steps per tier, the buckets' included; after ``close()`` too (what the run left)."""
        return {tier.name: tier.steps() for tier in [*self.tiers, *self._buckets.tiers]}
