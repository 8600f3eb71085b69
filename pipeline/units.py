"""The write path's vocabulary: the units that flow between the stages, and what a stage is.

A checkpoint enters the stages (pipeline/stages/) as one :class:`ObjectBatch` (its snapshotted
Python objects) and one :class:`ChunkPlan` per chunk of tensor bytes. Capture turns each plan into a
:class:`Chunk` held in a host-cache slab; serialize turns the object batch into a chunk of encoded
bytes; compress may replace a chunk's stored bytes; persist hands it to the data file's container.
:class:`Chunk` and :class:`ChunkEntry` are defined where containers take them (:mod:`tiers.format.container`).
A :class:`Stage` takes any unit: what it has nothing to do on goes past it (lanes.py), so each stage
says which units are its work and hands on what it made of them.

This module imports no stage and no planner: the planner (plan.py, plan_cache.py) makes these units,
the stages consume them, and neither imports the other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from ..providers.items import ObjectItem, TensorItem
from ..tiers.format.container import Chunk, ChunkEntry

__all__ = [
    "Chunk", "ChunkEntry", "ChunkPlan", "CopyProgram", "EagerSources", "ObjectBatch", "Stage", "TensorPiece",
    "Unit", "run_blocking",
]  # fmt: skip

T = TypeVar("T")


@dataclass(frozen=True)
class TensorPiece:
    """Bytes [item_offset, item_offset + length) of ``item`` land at ``chunk_offset`` in the chunk."""

    item: TensorItem
    item_offset: int
    length: int
    chunk_offset: int


@dataclass
class CopyProgram:
    """One chunk's copies, worked out once by capture and kept on its plan (a reused plan runs it every
    checkpoint): runs out of the eager stacks, merged where both sides are contiguous; pieces copied from
    their items' tensors; alignment gaps to zero; the entries the container records."""

    where: Mapping[str, tuple[int, int]]  # the eager sources it was made for
    entries: list[ChunkEntry]
    zeros: list[tuple[int, int]]
    runs: list[tuple[int, int, int, int]]  # (stack, start in it, start in the chunk, length)
    pieces: list[TensorPiece]
    element_size: int
    # The runs and pieces in the order of their bytes in the chunk, (is a piece, index): copied in that order,
    # a chunk of host bytes is hashed a block behind its copy (stages/capture.py).
    order: list[tuple[bool, int]]
    on_gpu: bool  # some piece is a GPU tensor's: copied last, on a side stream, and not hashed by capture
    # Per piece of a host tensor: its source bytes as numpy, and the tensor's data_ptr they were taken at.
    # Reused while the tensor still points there (the array holds that memory, so no other tensor can
    # be there), which spares four torch calls per piece: ~1 s of capture for 10^5 small tensors. Kept
    # only by a program that runs again (a reused plan's, whose pieces are live tensors): a plan made
    # for one checkpoint holds eager copies, which a failed checkpoint's error may keep alive with it.
    views: list[tuple[int, np.ndarray] | None] = field(default_factory=list)
    runs_before: int = 0


@dataclass
class ChunkPlan:
    """What capture copies into one slab: the pieces of tensors, packed end to end (plan.py)."""

    index: int
    pieces: list[TensorPiece] = field(default_factory=list)
    nbytes: int = 0
    program: CopyProgram | None = None  # how capture copies it, once worked out (stages/capture.py)


@dataclass
class ObjectBatch:
    """A checkpoint's Python objects, snapshotted at the request; serialize encodes them into one chunk."""

    objects: list[ObjectItem]


@dataclass
class EagerSources:
    """Where capture finds the bytes of items copied in batches on the trainer's thread (plan_cache.py):
    ``key -> (group, byte offset)`` in the stacks."""

    where: Mapping[str, tuple[int, int]]
    stacks: list[np.ndarray]  # each group's stack as flat bytes


Unit = ChunkPlan | ObjectBatch | Chunk


class Stage(Protocol):
    """One stage of the chain (pipeline/stages/), run on a lane's threads (lanes.py).

    For each unit the lane asks ``passes(unit)``: True means the stage has nothing to do on it, and the
    unit goes on untouched (counted as passed). Otherwise ``run(unit)`` does the stage's work and
    returns what it hands on (None: the unit ends here, written). Both are called from several worker
    threads at once; a stage guards what it shares with the job's lock.
    """

    def passes(self, unit: Unit) -> bool: ...

    def run(self, unit: Unit) -> Unit | None: ...


async def run_blocking(pool: concurrent.futures.Executor, fn: Callable[..., T], *args: Any) -> T:
    """Run blocking work in ``pool``; if cancelled, still wait for the thread before unwinding.

    Returning early on cancel would let the caller release a slab that a thread is still writing.
    The thread's own failure is then dropped, on purpose: the job is already failing for the error
    that cancelled it (a failing disk fails every write in flight), and left unread it would be
    printed as "Future exception was never retrieved" once per cancelled write.
    """
    future = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # read, so that asyncio does not report it as never retrieved
        raise
