"""The runner embedded in the trainer: ``checkpoint(step)`` returns at once, the pipeline does the rest.

It owns an asyncio loop on a background thread, the host cache and the worker thread pools. On
the trainer's thread ``checkpoint`` only asks the providers to describe their state (objects are
snapshotted, tensors referenced) and hands the plan to the loop; the tensor copies then run while
the next forward/backward runs, and the optimizer step pre-hook installed by ``attach`` waits only
if they are still pending. One checkpoint is in flight at a time; another request meanwhile
follows ``policies.in_flight`` (wait or skip), so nothing queues without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..providers.base import StateProvider
from ..providers.composite import CompositeProvider
from ..tiers.filesystem import FilesystemTier
from ..tiers.hostcache import HostCache
from .capture import SlabCopier, record_ready_event
from .config import PipelineConfig, load_config, parse_config
from .dist_restore import restore_across_ranks
from .distributed import DistributedCommit, group_for_runner
from .flush import Flusher, FlushFailure
from .handle import CheckpointHandle, CheckpointResult
from .job import CheckpointJob, JobContext, JobStats
from .plan import plan_checkpoint
from .restore import RestoreResult, restore_into

log = logging.getLogger("tierstate")


def _first_leaf(error: BaseException) -> BaseException:
    """TaskGroups wrap failures in ExceptionGroups; the user wants the one that started it."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


class Runner:
    def __init__(
        self,
        config: PipelineConfig,
        rank: int | None = None,
        *,
        distributed: bool | None = None,
        group_timeout: float = 600.0,
    ) -> None:
        """``distributed``: None = across all ranks when torch.distributed runs on several (then every
        rank must build its runner at the same point); ``group_timeout``: seconds a checkpoint
        collective waits for the slowest rank before the checkpoint fails."""
        self.config = config
        self._group = group_for_runner(distributed, rank, config.policies.in_flight, group_timeout)
        self.rank = self._group.rank if self._group is not None else rank or 0
        self.providers = CompositeProvider()
        self.tiers = [FilesystemTier(name, tier.path) for name, tier in config.tiers.items()]
        pinned = config.host_cache.pinned
        if pinned == "auto":
            pinned = torch.cuda.is_available()
        slab = max(4096, config.chunk_size // 4096 * 4096)
        compress = config.stage_of_kind("compress")
        scratch = compress.workers if compress is not None and compress.codec != "none" else 0
        self.cache = HostCache(config.host_cache.size, slab, pinned=bool(pinned), scratch=scratch)
        stage_workers = max(s.workers for _, s in config.chain() if s.kind != "persist")
        self._compute = concurrent.futures.ThreadPoolExecutor(stage_workers, thread_name_prefix="tierstate-cpu")
        self._io = concurrent.futures.ThreadPoolExecutor(
            config.chain()[-1][1].workers + 1, thread_name_prefix="tierstate-io"
        )
        self._copier = SlabCopier()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierstate-loop", daemon=True)
        self._thread.start()
        self._inflight: CheckpointHandle | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.history: list[tuple[CheckpointHandle, JobStats]] = []
        # Background flushes to slower tiers and retention (pipeline/flush.py); only the committing rank's.
        leader = self._group is None or self._group.is_leader
        self._flusher = Flusher(config, self.tiers, self._loop, active=leader)
        self.flush_failures: list[FlushFailure] = []
        # Not atexit.register: at interpreter exit the thread pools refuse new work before atexit
        # handlers run, so a drain from there fails the checkpoint in flight. Threading's own exit
        # hooks run earlier, newest first, so this one runs before the pools shut down.
        threading._register_atexit(_close_at_exit, weakref.ref(self))

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
    def register(self, **providers: StateProvider) -> None:
        for name, provider in providers.items():
            self.providers.add(name, provider)

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Install the step pre-hook that keeps the optimizer from mutating tensors not yet captured."""

        def before_step(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            self.wait_captured()

        return optimizer.register_step_pre_hook(before_step)

    @property
    def durable_tier(self) -> FilesystemTier:
        name = self.config.persist_tier
        return next(t for t in self.tiers if t.name == name)

    # --- checkpoint ---------------------------------------------------------------------------
    def checkpoint(self, step: int) -> CheckpointHandle:
        """Request a checkpoint of the registered state at ``step``; returns without waiting for I/O."""
        started = time.perf_counter()
        if self._closed:
            raise RuntimeError("runner is closed")
        handle = CheckpointHandle(step)
        with self._lock:
            previous = self._inflight
            if previous is not None and not previous.done():
                if self.config.policies.in_flight == "skip":
                    handle._set_skipped()
                    log.warning("checkpoint step %d skipped: step %d still in flight", step, previous.step)
                    handle.blocked_s = time.perf_counter() - started
                    return handle
                previous.wait()
            declined = None
            try:
                plan = plan_checkpoint(self.providers.describe(), self.cache.slab_size)
                ready = record_ready_event([item.tensor for item in plan.tensors])
            except Exception as exc:  # a provider bug must not stop training
                log.error("checkpoint step %d failed while describing state: %s", step, exc)
                if self._group is None:
                    handle._set_failed(exc)
                    handle.blocked_s = time.perf_counter() - started
                    return handle
                # The other ranks are opening this step: this one must take part, to decline it.
                declined, plan, ready = exc, plan_checkpoint([], self.cache.slab_size), None
            self._inflight = handle
            many = self._group is not None
            slab = self.cache.slab_size
            commit = DistributedCommit(self._group, self.durable_tier, slab, declined) if many else None
            ctx = JobContext(
                self.config, self.cache, self.durable_tier, self._compute, self._io, self._copier, self.rank, commit
            )
            job = CheckpointJob(ctx, step, plan, ready, lambda: handle._set_captured())
            asyncio.run_coroutine_threadsafe(self._run(job, handle), self._loop)
        handle.blocked_s = time.perf_counter() - started
        return handle

    async def acheckpoint(self, step: int) -> CheckpointResult:
        """For async trainers: request a checkpoint and await its durability without blocking the loop."""
        handle = self.checkpoint(step)
        await asyncio.get_running_loop().run_in_executor(None, handle.wait)
        return handle.result()

    async def _run(self, job: CheckpointJob, handle: CheckpointHandle) -> None:
        try:
            path = await job.run()
        except BaseException as exc:  # report, never raise into training
            error = _first_leaf(exc)
            log.error("checkpoint step %d failed: %s: %s", job.step, type(error).__name__, error)
            handle._set_failed(error)
            self.history.append((handle, job.stats))
            if not isinstance(exc, Exception):
                raise
            return
        self.history.append((handle, job.stats))
        handle._set_durable(
            CheckpointResult(
                step=job.step,
                tier=self.durable_tier.name,
                path=path,
                raw_bytes=job.stats.raw_bytes,
                stored_bytes=job.stats.stored_bytes,
                capture_s=job.stats.capture_s,
                durable_s=job.stats.durable_s,
            )
        )
        self._flusher.committed(handle)

    def wait_captured(self) -> float:
        """Block until the pending checkpoint's tensors are copied out; returns the seconds blocked."""
        handle = self._inflight
        if handle is None or handle.wait_captured(0):
            return 0.0
        started = time.perf_counter()
        handle.wait_captured()
        blocked = time.perf_counter() - started
        handle.blocked_s += blocked
        return blocked

    def wait(self) -> None:
        """Block until the checkpoint in flight (if any) is durable or failed."""
        handle = self._inflight
        if handle is not None:
            handle.wait()

    # --- restore ------------------------------------------------------------------------------
    def restore(self, which: int | str = "latest", fallback: bool = False) -> RestoreResult:
        """Load a committed checkpoint into the registered providers, in place; fastest tier first.

        ``fallback=True``: if no copy of ``which`` reads clean, take the newest older step that does.
        """
        self.wait()
        allow_pickle = self.config.policies.allow_pickle
        if self._group is not None:
            return restore_across_ranks(self._group, self.providers, self.tiers, which, allow_pickle, fallback)
        return restore_into(self.providers, self.tiers, which, allow_pickle=allow_pickle, fallback=fallback)

    # --- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Drain: the checkpoint in flight becomes durable or is reported failed, every background flush
        finishes or is reported (``flush_failures``, and each handle's ``flush_errors``); then stop threads."""
        if self._closed:
            return
        self._closed = True
        self.wait()
        self.flush_failures = self._flusher.drain()  # every flush done or reported
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._compute.shutdown()
        self._io.shutdown()
        self._flusher.close()
        if self._group is not None:
            self._group.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steps(self) -> dict[str, list[int]]:
        """Committed steps per tier."""
        return {tier.name: tier.steps() for tier in self.tiers}


def _close_at_exit(ref: weakref.ref[Runner]) -> None:
    """A trainer that forgets close() still gets its last requested checkpoint made durable."""
    runner = ref()
    if runner is not None:
        runner.close()
