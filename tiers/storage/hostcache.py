"""The host cache: one fixed pool of host memory, allocated once, cut into equal slabs.

Every tensor byte on its way to storage passes through a slab. The pool is never grown: when all
slabs are in use, ``acquire`` waits until persist releases one. That wait *is* the backpressure
that keeps memory bounded when the state is larger than the cache, and reusing the same (pinned,
when CUDA is present) memory avoids paying for allocation and page-locking at every checkpoint.

The pool is touched once when it is created, so its pages are resident before training starts:
left to ``torch.empty`` the kernel would fault in (and zero) the pages during the first
checkpoint, which measured ~3.5 s of extra capture for a 2 GiB pool on a 2-core VM, all of it
on the trainer's critical path. Slabs start at 4 KiB boundaries (``ALIGN``) so that persist can
hand them to ``O_DIRECT`` writes as they are.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

ALIGN = 4096


@dataclass(eq=False)
class Slab:
    index: int
    tensor: torch.Tensor  # uint8, slab_size bytes

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` as a memoryview, for writing and hashing without a copy."""
        return self.tensor[:nbytes].numpy().data.cast("B")


class HostCache:
    """``scratch`` slabs of the pool are set aside for compress workers (shuffle and zstd output), so
    that compression, too, uses no memory beyond the configured size; they are only carved out when
    at least two slabs remain for capture, else ``scratch_count`` is 0 and compress allocates its own."""

    def __init__(self, size: int, slab_size: int, pinned: bool, scratch: int = 0) -> None:
        if slab_size <= 0 or size < 2 * slab_size:
            raise ValueError(f"host cache of {size} bytes cannot hold two slabs of {slab_size} bytes")
        self.slab_size = slab_size
        total = size // slab_size
        self.scratch_count = scratch if total - scratch >= 2 else 0
        self.slab_count = total - self.scratch_count
        self.pinned = pinned
        nbytes = total * slab_size
        backing = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
        shift = -backing.data_ptr() % ALIGN
        self._pool = backing[shift : shift + nbytes]
        self._pool.zero_()  # fault every page in now, not during the first checkpoint's capture
        slabs = [Slab(i, self._pool[i * slab_size : (i + 1) * slab_size]) for i in range(total)]
        self._slabs, self._scratch_slabs = slabs[: self.slab_count], slabs[self.slab_count :]
        self._free = list(reversed(self._slabs))  # acquired from the end: lowest index first
        self._free_scratch = list(self._scratch_slabs)
        # Acquired and released by the pipeline's stage threads, never on the event loop (stage_threads.py).
        self._changed = threading.Condition()
        self.in_use = 0
        self.peak_in_use = 0
        self.waits = 0

    @property
    def nbytes(self) -> int:
        return self._pool.numel()

    def acquire(self, interrupted: threading.Event) -> Slab | None:
        """A free slab, waiting while there is none; None once ``interrupted`` is set (and :meth:`wake` called)."""
        with self._changed:
            if not self._free:
                self.waits += 1
            while not self._free:
                if interrupted.is_set():
                    return None
                self._changed.wait()
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return self._free.pop()

    def release(self, slab: Slab) -> None:
        with self._changed:
            self.in_use -= 1
            self._free.insert(0, slab)  # used again last: the slab persist just wrote stays the coldest
            self._changed.notify_all()

    def acquire_scratch(self, interrupted: threading.Event) -> Slab | None:
        """A scratch slab (``scratch_count`` > 0); never competes with capture, so it cannot deadlock it."""
        with self._changed:
            while not self._free_scratch:
                if interrupted.is_set():
                    return None
                self._changed.wait()
            return self._free_scratch.pop()

    def release_scratch(self, slab: Slab) -> None:
        with self._changed:
            self._free_scratch.append(slab)
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake every waiting ``acquire`` so that one whose ``interrupted`` is now set returns None."""
        with self._changed:
            self._changed.notify_all()
