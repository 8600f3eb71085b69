"""The host cache: one fixed pool of host memory, allocated once, cut into equal slabs.

Every tensor byte on its way to storage passes through a slab. The pool is never grown: when all
slabs are in use, ``acquire`` waits until persist releases one. That wait *is* the backpressure
that keeps memory bounded when the state is larger than the cache, and reusing the same (pinned,
when CUDA is present) memory avoids paying for allocation and page-locking at every checkpoint.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Slab:
    index: int
    tensor: torch.Tensor  # uint8, slab_size bytes

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` as a memoryview, for writing and hashing without a copy."""
        return memoryview(self.tensor[:nbytes].numpy()).cast("B")


class HostCache:
    def __init__(self, size: int, slab_size: int, pinned: bool) -> None:
        if slab_size <= 0 or size < 2 * slab_size:
            raise ValueError(f"host cache of {size} bytes cannot hold two slabs of {slab_size} bytes")
        self.slab_size = slab_size
        self.slab_count = size // slab_size
        self.pinned = pinned
        self._pool = torch.empty(self.slab_count * slab_size, dtype=torch.uint8, pin_memory=pinned)
        self._pool.zero_()  # fault every page in now, not during the first checkpoint's capture
        self._slabs = [Slab(i, self._pool[i * slab_size : (i + 1) * slab_size]) for i in range(self.slab_count)]
        self._free: asyncio.Queue[Slab] | None = None
        self.in_use = 0
        self.peak_in_use = 0
        self.waits = 0

    @property
    def nbytes(self) -> int:
        return self._pool.numel()

    def _queue(self) -> asyncio.Queue[Slab]:
        # Created on first use so it binds to the runner's loop, not the constructing thread's.
        if self._free is None:
            self._free = asyncio.Queue()
            for slab in self._slabs:
                self._free.put_nowait(slab)
        return self._free

    async def acquire(self) -> Slab:
        free = self._queue()
        if free.empty():
            self.waits += 1
        slab = await free.get()
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return slab

    def release(self, slab: Slab) -> None:
        self.in_use -= 1
        self._queue().put_nowait(slab)
