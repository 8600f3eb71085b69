"""One checkpoint's trip through the stage graph, from plan to commit.

The job is a coroutine on the runner's loop: plan, open, commit. In between, the units flow through
the stages built from the YAML chain on threads joined by bounded queues (stage_threads.py says why
not through the loop); each stage runs ``workers`` of them. The feeder blocks on a full queue and
capture blocks on a full host cache, so no queue or buffer grows with the size of the state. Any
failure stops the whole flow, returns every slab, removes the partial directory and leaves the
committed checkpoints as they were.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tiers import codecs
from ..tiers.filesystem import FilesystemTier
from ..tiers.hostcache import HostCache, Slab
from ..tiers.objcodec import ObjectCodecError, encode_object
from .capture import SlabCopier
from .commit import Commit, TierCommit
from .config import PipelineConfig
from .config_schema import CompressStage, PersistStage, SerializeStage
from .lanes import Lane, Step, run_lane
from .metrics import CheckpointStats, StageStats
from .persist import TierWriter
from .plan import CheckpointPlan, ChunkPlan, plan_checkpoint
from .plan_cache import EagerSources
from .retry import storage_call
from .room import Room
from .stage_threads import Flow, Handoff, Stopped, run_workers
from .units import Chunk, ChunkEntry, ObjectBatch, run_blocking


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
    ) -> None:
        """``plan``: what to write, or what makes it in the background before the step is opened (a reused
        plan checked, an optimizer's state listed: plan_cache.Resolve), failing the checkpoint if the plan
        no longer fits the tensors; ``stats``: the handle's, which this job fills in (the trainer's side is
        already there); ``sources``: the eager copies made in batches (plan_cache.py)."""
        self.ctx = ctx
        self.step = step
        self._planned = plan
        if isinstance(plan, CheckpointPlan):
            self.plan = plan  # otherwise set by run(), once made
        self.ready = ready
        self.on_captured = on_captured
        self.stats = stats
        self.sources = sources
        self._held: set[Slab] = set()
        self._lock = threading.Lock()  # the stage threads share _held, the counters and the stage stats
        self._flow_state = Flow()  # replaced by each flow's (_flow)
        self._to_capture = 0  # this rank's chunks, once the step is open
        self._started = time.monotonic()
        self._writer: TierWriter | None = None
        compress = ctx.config.stage_of_kind("compress")
        # Capture checksums each host chunk while it is hot in the cache, unless compression stores other
        # bytes (a GPU's chunks are checksummed by persist: capture.py says why).
        self._hash_raw = not isinstance(compress, CompressStage) or compress.codec == "none"

    async def run(self) -> Path:
        tier = self.ctx.tier
        commit = self.ctx.commit or TierCommit(tier)
        plan = self._planned
        if not isinstance(plan, CheckpointPlan):  # before opening: with many ranks, each offers what it will write
            try:
                plan = await run_blocking(self.ctx.compute, plan)
            except Exception as exc:
                if not commit.decline(exc):
                    raise
                plan = plan_checkpoint([], self.ctx.cache.slab_size)  # declined: nothing of it is written
        partial, self.plan = await run_blocking(self.ctx.io, commit.begin, self.step, plan)
        self._to_capture = len(self.plan.chunks)  # with many ranks, only this rank's share
        try:
            if self.ctx.room is not None:
                await self.ctx.room.reserve(self.step, self.plan.tensor_bytes)
            if not self._to_capture:
                self._captured()
            self._writer = await TierWriter.open(
                tier.name, partial, self.ctx.rank, self.step, self.plan, self._persist_stage(),
                self.ctx.config.align, self.ctx.io,
            )
            await self._flow()
            manifest = await self._writer.finish()
            self.stats.written_s = time.monotonic() - self._started
            # What this rank's part cost, for `tierstate stats`: the commit itself is not in it.
            manifest["stats"] = {str(self.ctx.rank): self.stats.manifest_body()}
            where = f"tier {tier.name}: committing {partial}"
            final = await storage_call(self.ctx.io, where, commit.commit, self.step, manifest)
        except BaseException as exc:
            if self._writer is not None:
                self._writer.close()
            await run_blocking(self.ctx.io, commit.abort, self.step, exc)
            raise
        finally:
            for slab in list(self._held):
                self._release(slab)
        self.stats.durable_s = time.monotonic() - self._started
        return final

    def _persist_stage(self) -> PersistStage:
        stage = self.ctx.config.chain()[-1][1]
        assert isinstance(stage, PersistStage)  # the config guarantees the chain ends in persist
        return stage

    async def _flow(self) -> None:
        """Every unit through the chain, on the lanes' threads (lanes.py, stage_threads.py)."""
        chain = self.ctx.config.chain()
        flow = self._flow_state = Flow()
        flow.on_stop(self.ctx.cache.wake)
        work = {"capture": self._capture, "serialize": self._serialize, "compress": self._compress,
                "persist": self._persist}
        lanes: list[Lane] = []
        pools: list[concurrent.futures.Executor] = []
        for name, stage in chain:
            stats = self.stats.stages[name] = StageStats()
            step = Step(stats, work[stage.kind], self._passes(stage))
            if stage.workers:  # capture always has some (config.py): the first lane starts with it
                # Past capture every chunk holds a host-cache slab, so the cache already bounds what is
                # queued there; a smaller bound would only hold capture back behind persist (measured:
                # 1.5 GB captured in 0.7 s instead of 0.2 s with a cache holding all of it), and capture
                # is what the trainer waits for.
                bound = stage.queue if not lanes else max(stage.queue, self.ctx.cache.slab_count)
                stats.queue_bound = bound
                lanes.append(Lane([step], stage.workers, Handoff(bound, flow)))
                pools.append(self.ctx.io if stage.kind == "persist" else self.ctx.compute)
            else:
                lanes[-1].steps.append(step)
        units: list[object] = [ObjectBatch(self.plan.objects)] if self.plan.objects else []
        units += self.plan.chunks  # objects first: their (small) serialization overlaps the tensor copies
        calls: list[tuple[concurrent.futures.Executor, Callable[..., None], tuple]] = [
            (self.ctx.compute, self._feed, (units, lanes[0].inbox))
        ]
        for i, (lane, pool) in enumerate(zip(lanes, pools, strict=True)):
            left = [lane.workers]  # the last of them to finish closes the next lane's queue
            calls += [(pool, run_lane, (lanes, i, self._lock, left))] * lane.workers
        try:
            await run_workers(flow, calls)
        finally:
            for lane in lanes:
                lane.steps[0].stats.queued(lane.inbox.peak)

    def _feed(self, units: list[object], queue: Handoff) -> None:
        for unit in units:
            queue.put(unit)
        queue.close()

    def _passes(self, stage: object) -> Callable[[object], bool]:
        """Whether ``stage`` has nothing to do on a unit, which then goes past it (lanes.py)."""
        if isinstance(stage, SerializeStage):
            return lambda unit: isinstance(unit, Chunk)  # tensor bytes are already their serialized form
        if isinstance(stage, CompressStage) and stage.codec == "none":
            return lambda _: True
        if isinstance(stage, CompressStage):
            return lambda unit: isinstance(unit, Chunk) and not len(unit.raw)  # nothing to compress
        return lambda _: False

    def _release(self, slab: Slab) -> None:
        with self._lock:
            if slab not in self._held:
                return
            self._held.discard(slab)
        self.ctx.cache.release(slab)

    def _captured(self) -> None:
        self.stats.capture_s = time.monotonic() - self._started
        self.on_captured()

    def _capture(self, unit: object) -> object:
        if isinstance(unit, ObjectBatch):
            return unit
        assert isinstance(unit, ChunkPlan)
        asked = time.monotonic()
        slab = self.ctx.cache.acquire(self._flow_state.stopped)
        if slab is None:
            raise Stopped
        with self._lock:
            self.stats.cache_wait_s += time.monotonic() - asked
            self._held.add(slab)
        chunk = self.ctx.copier.copy(unit, slab, self.ready, self.sources, self._hash_raw)
        with self._lock:
            self._to_capture -= 1
            last = self._to_capture == 0
        if last:
            self._captured()
        return chunk

    def _serialize(self, batch: object) -> Chunk:
        """Python objects into one chunk (tensor chunks go past this stage: ``_passes``)."""
        assert isinstance(batch, ObjectBatch)
        allow = self.ctx.config.policies.allow_pickle
        parts, entries, offset = [], [], 0
        for item in batch.objects:
            try:
                data = encode_object(item.value, item.serializer, allow)
            except ObjectCodecError as exc:
                raise ObjectCodecError(f"item {item.key!r}: {exc}") from None
            entries.append(ChunkEntry(item.key, 0, len(data), offset))
            parts.append(data)
            offset += len(data)
        return Chunk(entries=entries, raw=memoryview(b"".join(parts)))

    def _compress(self, chunk: object) -> Chunk:
        assert isinstance(chunk, Chunk)  # serialize hands on only chunks
        stage = self.ctx.config.stage_of_kind("compress")
        assert isinstance(stage, CompressStage) and stage.codec != "none"  # otherwise it passes chunks on
        width = chunk.element_size if stage.shuffle == "auto" else 1
        cache = self.ctx.cache
        if chunk.slab is not None and cache.scratch_count:
            # Shuffle into a scratch slab, stream the frame back into the chunk's own slab: compression
            # allocates nothing outside the host cache (the slab is then held until persisted).
            scratch = cache.acquire_scratch(self._flow_state.stopped)
            if scratch is None:
                raise Stopped
            try:
                done = codecs.compress_into(chunk.raw, scratch.tensor, stage.level, stage.threads, width)
            finally:
                cache.release_scratch(scratch)
            if done is not None:
                chunk.stored, chunk.codec, chunk.shuffle = chunk.slab.view(done[0]), "zstd", done[1]
            return chunk
        packed = codecs.compress(chunk.raw, stage.level, stage.threads, width)
        if packed is not None:
            chunk.stored, chunk.codec, chunk.shuffle = packed.data, packed.codec, packed.shuffle
            if chunk.slab is not None:
                self._release(chunk.slab)  # the compressed copy is independent: free the slab early
                chunk.slab = None
        return chunk

    def _persist(self, chunk: object) -> None:
        assert isinstance(chunk, Chunk)  # serialize and compress hand on only chunks
        assert self._writer is not None
        self._writer.write(chunk, self._flow_state.sleep)
        with self._lock:
            self.stats.raw_bytes += len(chunk.raw)
            self.stats.stored_bytes += len(chunk.payload)
            self.stats.chunks += 1
        if chunk.slab is not None:
            self._release(chunk.slab)
