"""The persist stage: this rank's files on the durable tier, in either container format.

The writers in tiers (:mod:`tiers.format.rankwriter` over :mod:`tiers.format.container`) only block and raise
OSError. This is the one place where the pipeline calls them, so whichever format the YAML picks
(``persist.format``), the same rules hold: every call runs in the I/O pool, except chunk writes, which
run on the threads of the lane that ends with persist (its own workers there, or with ``workers: 0``
the threads of the stage before it: lanes.py); a chunk write or the index that fails with a
transient error is retried under ``persist.retries`` and ``backoff``; the data fsync is never
retried (:mod:`pipeline.retry` says why); every OSError becomes a TierError that names the tier and
the file; the write rate stays under ``persist.bandwidth``.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path

from ...tiers.format.container import Chunk, Layout
from ...tiers.format.format import ManifestBody
from ...tiers.format.rankwriter import RankWriter, data_file_path
from ...tiers.format.slotfile import SlotFile, SlotRegion
from ...tiers.ops.pacing import Pacer
from ..config_stages import PersistStage
from ..metrics import CheckpointStats
from ..plan import CheckpointPlan, tensor_layout
from ..retry import RetryPolicy, storage_call, storage_call_here
from ..units import Unit
from .slabs import HeldSlabs


def plan_layout(plan: CheckpointPlan) -> Layout:
    """What this rank's data file holds, as its container needs to know it before the bytes arrive."""
    fixed = plan.layouts  # a reused plan's, worked out once
    tensors = {**fixed, **{item.key: tensor_layout(item) for item in plan.tensors if item.key not in fixed}}
    objects = {item.key: item.serializer for item in plan.objects}
    return Layout(tensors, objects, dict(plan.aliases))


def _open(
    directory: Path, rank: int, step: int, plan: CheckpointPlan, stage: PersistStage, align: int,
    slot: SlotRegion | None,
) -> RankWriter:  # fmt: skip
    """A new data file in ``directory``, or the slot (already there, the tensor frames in ``slot``) as one."""
    path = data_file_path(directory, rank, stage.format)
    container = None if slot is None else SlotFile(path, align, slot)
    return RankWriter(directory, rank, step, plan_layout(plan), stage.format, align, stage.io, container)


class TierWriter:
    """One rank's files of one checkpoint on tier ``tier``, written through :class:`RankWriter`."""

    def __init__(
        self,
        tier: str,
        writer: RankWriter,
        pool: concurrent.futures.Executor,
        retry: RetryPolicy,
        pacer: Pacer,
    ) -> None:
        self.tier = tier
        self.writer = writer
        self._pool = pool
        self._retry = retry
        self._pacer = pacer

    @classmethod
    async def open(
        cls,
        tier: str,
        directory: Path,
        rank: int,
        step: int,
        plan: CheckpointPlan,
        stage: PersistStage,
        align: int,
        pool: concurrent.futures.Executor,
        slot: SlotRegion | None = None,
    ) -> TierWriter:
        """Create the data file (HDF5: and declare the plan's tensors) in ``directory``, or open the memory tier's
        slot already there (``slot``: where its tensor frames lie); not retried."""
        where = f"tier {tier}: creating {data_file_path(directory, rank, stage.format)}"
        writer = await storage_call(pool, where, _open, directory, rank, step, plan, stage, align, slot)
        return cls(tier, writer, pool, RetryPolicy(stage.retries, stage.backoff), Pacer(stage.bandwidth))

    def write(self, chunk: Chunk, sleep: Callable[[float], None]) -> None:
        """On a persist worker's thread: ``chunk`` written (transient errors retried), then paced;
        ``sleep`` waits (the flow's: a failure elsewhere ends it early, stage_threads.py)."""
        where = f"tier {self.tier}: writing {self.writer.path}"
        storage_call_here(where, self.writer.write, chunk, retry=self._retry, sleep=sleep)
        delay = self._pacer.delay(len(chunk.payload))
        if delay:
            sleep(delay)

    async def finish(self) -> ManifestBody:
        """fsync the data file (never retried), write the index; this rank's manifest in JSON form."""
        file = await storage_call(self._pool, f"tier {self.tier}: fsync of {self.writer.path}", self.writer.finish)
        where = f"tier {self.tier}: writing {self.writer.index_path}"
        return await storage_call(self._pool, where, self.writer.write_index, file, retry=self._retry)

    def close(self) -> None:
        """Abandon the data file after a failure."""
        self.writer.close()


class Persist:
    """The stage: each chunk written through ``writer``, counted, and its slab given back. Every unit that
    reaches it must be a chunk by then (capture, serialize): anything else would be lost from the
    checkpoint, so it fails the checkpoint instead."""

    def __init__(self, writer: TierWriter, slabs: HeldSlabs, stats: CheckpointStats, lock: threading.Lock) -> None:
        self._writer = writer
        self._slabs = slabs
        self._stats = stats
        self._lock = lock

    def passes(self, unit: Unit) -> bool:  # noqa: ARG002  # every unit is written
        return False

    def run(self, unit: Unit) -> None:
        if not isinstance(unit, Chunk):
            raise TypeError(f"tier {self._writer.tier}: a {type(unit).__name__} reached persist unconverted")
        self._writer.write(unit, self._slabs.flow.sleep)
        with self._lock:
            self._stats.raw_bytes += len(unit.raw)
            self._stats.stored_bytes += len(unit.payload)
            self._stats.chunks += 1
        if unit.slab is not None:
            self._slabs.give_back(unit.slab)
