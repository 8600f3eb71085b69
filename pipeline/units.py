"""What flows through the stage queues.

A checkpoint enters the pipeline as one :class:`ObjectBatch` (its snapshotted Python objects) and
one :class:`~pipeline.plan.ChunkPlan` per chunk of tensor bytes. Capture turns plans into
:class:`Chunk` s held in host-cache slabs; serialize turns the object batch into a chunk of
encoded bytes; compress may replace a chunk's stored bytes; persist hands it to the data file's
container. :class:`Chunk` and :class:`ChunkEntry` are defined where containers take them
(:mod:`tiers.container`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..providers.items import ObjectItem
from ..tiers.container import Chunk, ChunkEntry

__all__ = ["Chunk", "ChunkEntry", "ObjectBatch", "run_blocking"]

T = TypeVar("T")


@dataclass
class ObjectBatch:
    objects: list[ObjectItem]


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
