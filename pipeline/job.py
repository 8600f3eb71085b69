"""One checkpoint's trip through the stage graph: plan, begin, flow, commit.

The job is a coroutine on the runner's loop. It settles the plan (in the background when it is a
reused one still to be checked), opens the step (``commit.begin``: with many ranks, this rank's share
of the plan), opens this rank's data file, lets the units flow through the stages built from the YAML
chain (pipeline/stages/, one file each, on the lanes' threads: lanes.py, stage_threads.py), and
commits. The feeder blocks on a full queue and capture on a full host cache, so no queue or buffer
grows with the size of the state. Any failure stops the whole flow, returns every slab, removes the
partial directory and leaves the committed checkpoints as they were.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tiers.format.rankwriter import data_file_path
from ..tiers.format.slotfile import SlotRegion
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.hostcache import HostCache
from ..tiers.storage.slots import SlotPool
from .commit import Commit, TierCommit
from .config import PipelineConfig
from .config_stages import CaptureStage, CompressStage, PersistStage, SerializeStage, StageConfig
from .lanes import Step, lanes_of, run_flow
from .metrics import CheckpointStats, StageStats
from .plan import CheckpointPlan, plan_checkpoint
from .retry import storage_call
from .room import Room
from .slotjob import SlotLayout, SlotWindows
from .stage_threads import Flow
from .stages.capture import Capture, SlabCopier
from .stages.compress import Compress
from .stages.persist import Persist, TierWriter
from .stages.serialize import Serialize
from .stages.slabs import HeldSlabs
from .units import EagerSources, ObjectBatch, Stage, Unit, run_blocking


@dataclass
class JobContext:
    """What a job borrows from its runner: the config, the cache and the thread pools."""

    config: PipelineConfig
    cache: HostCache
    tier: FilesystemTier
    compute: concurrent.futures.Executor
    io: concurrent.futures.Executor
    copier: SlabCopier
    rank: int = 0
    commit: Commit | None = None  # None: this process alone commits on ``tier``
    room: Room | None = None  # ``tier``'s size is bounded (a memory tier): reserve room before writing
    slots: SlotPool | None = None  # ``tier`` is a memory tier captured into directly (slotjob.py)


class CheckpointJob:
    def __init__(
        self,
        ctx: JobContext,
        step: int,
        plan: CheckpointPlan | Callable[[], CheckpointPlan],
        ready: torch.cuda.Event | None,
        on_captured: Callable[[], None],
        stats: CheckpointStats,
        sources: EagerSources | None = None,
        requested: float | None = None,
    ) -> None:
        """``plan``: what to write, or what makes it in the background before the step is opened (a reused
        plan checked, an optimizer's state listed: plan_cache.Resolve), failing the checkpoint if the plan
        no longer fits the tensors; ``stats``: the handle's, which this job fills in (the trainer's side is
        already there); ``sources``: the eager copies made in batches (plan_cache.py); ``requested``: when
        ``checkpoint()`` was called (``time.monotonic()``), which the stats' seconds count from (default:
        now)."""
        self.ctx = ctx
        self.step = step
        self._planned = plan
        if isinstance(plan, CheckpointPlan):
            self.plan = plan  # otherwise set by run(), once made
        self.ready = ready
        self.on_captured = on_captured
        self.stats = stats
        self.sources = sources
        self._lock = threading.Lock()  # the stage threads share the slabs, the counters and the stage stats
        self.flow = Flow()
        self.slabs = HeldSlabs(ctx.cache, self.flow, self._lock, stats)
        self._windows: SlotWindows | None = None  # captured into a slot: its windows, once taken
        self._started = time.monotonic() if requested is None else requested

    async def run(self) -> Path:
        commit = self.ctx.commit or TierCommit(self.ctx.tier)
        plan = await self._plan(commit)
        partial, self.plan = await run_blocking(self.ctx.io, commit.begin, self.step, plan)
        writer: TierWriter | None = None
        try:
            writer = await self._begin(partial)
            await self._flow(writer)
            final = await self._commit(commit, partial, writer)
        except BaseException as exc:
            if writer is not None:
                writer.close()
            if self._windows is not None and self.ctx.slots is not None:  # its slot back for the next checkpoint
                await run_blocking(self.ctx.io, self.ctx.slots.put_back, self._windows.slot, self._windows.path)
            await run_blocking(self.ctx.io, commit.abort, self.step, exc)
            raise
        finally:
            self.slabs.give_back_all()
        self.stats.durable_s = time.monotonic() - self._started
        return final

    async def _plan(self, commit: Commit) -> CheckpointPlan:
        """The plan, made in the background if it was not at the request; with many ranks, a rank whose plan
        fails declines the step (every rank then gives it up) instead of leaving the others waiting."""
        plan = self._planned
        if isinstance(plan, CheckpointPlan):
            return plan
        try:
            return await run_blocking(self.ctx.compute, plan)
        except Exception as exc:
            if not commit.decline(exc):
                raise
            return plan_checkpoint([], self.ctx.cache.slab_size)  # declined: nothing of it is written

    async def _begin(self, partial: Path) -> TierWriter:
        """Room on a bounded tier, then this rank's data file in ``partial``: a slot of the memory tier, when
        the tensors are captured into one (slotjob.py), else a new file."""
        config = self.ctx.config
        pool = self.ctx.slots if self.plan.chunks else None  # no tensor bytes: nothing to capture into a slot
        layout = SlotLayout.of(self.plan.chunks, config.align) if pool is not None else None
        if self.ctx.room is not None:
            # A free slot's pages are in the tier already: taking it adds only what it lacks.
            reused = None if pool is None or layout is None else functools.partial(pool.reusable, layout.size)
            await self.ctx.room.reserve(self.step, self.plan.tensor_bytes, reused)
        if not self.plan.chunks:
            self._captured()
        region = None if pool is None or layout is None else await self._take_slot(pool, layout, partial)
        return await TierWriter.open(
            self.ctx.tier.name, partial, self.ctx.rank, self.step, self.plan, _persist_stage(config), config.align,
            self.ctx.io, region,
        )  # fmt: skip

    async def _take_slot(self, pool: SlotPool, layout: SlotLayout, partial: Path) -> SlotRegion:
        """This rank's slot, renamed to its data file in ``partial``; capture copies into its windows."""
        path = data_file_path(partial, self.ctx.rank, "frames")
        where = f"tier {self.ctx.tier.name}: taking a slot for {path}"
        slot = await storage_call(self.ctx.io, where, pool.take, layout.size, path)
        self._windows = SlotWindows(slot, layout, path)
        return layout.region(slot)

    async def _flow(self, writer: TierWriter) -> None:
        """Every unit through the chain, on the lanes' threads (lanes.py, stage_threads.py)."""
        self.flow.on_stop(self.ctx.cache.wake)
        chain: list[tuple[StageConfig, Step]] = []
        for name, config in self.ctx.config.chain():
            stats = self.stats.stages[name] = StageStats(timeline=self.stats.timeline, name=name)
            chain.append((config, Step(stats, self._stage(config, writer))))
        lanes = lanes_of(chain, self.flow, self.ctx.cache.slab_count)
        pools = [self.ctx.io if isinstance(lane.steps[0].stage, Persist) else self.ctx.compute for lane in lanes]
        units: list[Unit] = [ObjectBatch(self.plan.objects)] if self.plan.objects else []
        units += self.plan.chunks  # objects first: their (small) serialization overlaps the tensor copies
        await run_flow(self.flow, list(zip(lanes, pools, strict=True)), units, self.ctx.compute, self._lock)

    def _stage(self, config: StageConfig, writer: TierWriter) -> Stage:
        if isinstance(config, CaptureStage):
            # Capture checksums each host chunk while it is hot in the cache, unless compression stores other
            # bytes (a GPU's chunks are checksummed by persist: stages/capture.py says why).
            compress = self.ctx.config.stage_of_kind("compress")
            hash_raw = compress is None or compress.codec == "none"
            chunks = len(self.plan.chunks)  # with many ranks, only this rank's share
            slabs = self._windows or self.slabs  # a slot's windows, or host-cache slabs
            return Capture(
                slabs, self.ctx.copier, self.ready, self.sources, hash_raw, chunks, self._captured, self._lock
            )
        if isinstance(config, SerializeStage):
            return Serialize(self.ctx.config.policies.allow_pickle)
        if isinstance(config, CompressStage):
            return Compress(config, self.slabs)
        return Persist(writer, self.slabs, self.stats, self._lock)

    async def _commit(self, commit: Commit, partial: Path, writer: TierWriter) -> Path:
        """fsync and index this rank's files, then commit the step (with many ranks, once all are there)."""
        manifest = await writer.finish()
        self.stats.written_s = time.monotonic() - self._started
        # What this rank's part cost, for `tierstate stats`: the commit itself is not in it.
        manifest["stats"] = {str(self.ctx.rank): self.stats.manifest_body()}
        where = f"tier {self.ctx.tier.name}: committing {partial}"
        return await storage_call(self.ctx.io, where, commit.commit, self.step, manifest)

    def _captured(self) -> None:
        self.stats.capture_s = time.monotonic() - self._started
        self.on_captured()


def _persist_stage(config: PipelineConfig) -> PersistStage:
    stage = config.stage_of_kind("persist")
    if stage is None:  # the config's checks make every chain end in persist: a config built around them
        raise ValueError("pipeline: the stage chain has no persist stage")
    return stage
