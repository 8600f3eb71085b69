"""Writing frames into one rank's data file: offsets reserved in order, writes run concurrently.

Each chunk becomes one frame at an aligned offset (holes between frames read back as zeros), so
several persist workers can ``pwrite`` at once without a lock around the file. The checksum is
computed from the very bytes handed to the kernel, in the same worker thread.

Raw frames still in their host-cache slab are written with ``O_DIRECT`` where the file system
allows it (``io: auto``): a buffered write first copies every byte into the page cache and the
final fsync then waits for all of it, which measured ~0.6 GB/s on a disk that takes ~1.5-2.3 GB/s
O_DIRECT (benchmarks/RESULTS.md); direct writes go from the slab to the device, cost no CPU copy
and leave no checkpoint-sized page cache behind. The slab is 4 KiB aligned and frames start at
``align`` boundaries, so only the tail up to the next 4 KiB is padded (zeros, trimmed at finish).
Compressed and object frames (arbitrary Python buffers) are written buffered through a second
descriptor; one fsync at the end covers both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import time
from pathlib import Path

from ..tiers import faults
from ..tiers.format import FileRecord, FrameRecord, checksum
from ..tiers.hostcache import Slab
from .retry import RetryPolicy, storage_call
from .units import Chunk, run_blocking

DIRECT_ALIGN = 4096  # O_DIRECT needs buffer, offset and length aligned to the logical block size (<= 4 KiB)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    faults.point("persist.write")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _hash_and_write(fd: int, data: memoryview | bytes, offset: int) -> str:
    view = memoryview(data).cast("B")
    digest = checksum(view)
    _write_all(fd, view, offset)
    return digest


def _hash_and_write_direct(fd: int, slab: Slab, length: int, offset: int) -> str:
    """Write the slab's first ``length`` bytes with O_DIRECT, zero-padded to the next 4 KiB."""
    padded = -(-length // DIRECT_ALIGN) * DIRECT_ALIGN
    if padded > length:
        slab.tensor[length:padded].zero_()  # no stale bytes of an earlier checkpoint on disk
    digest = checksum(slab.view(length))
    _write_all(fd, slab.view(padded), offset)
    return digest


def _open_direct(path: Path) -> int:
    """A second, O_DIRECT descriptor on ``path``, or -1 where the OS or file system has none (tmpfs, macOS)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return -1


class FrameWriter:
    def __init__(
        self,
        path: Path,
        align: int,
        bandwidth: int | None,
        pool: concurrent.futures.Executor,
        io: str = "auto",
        retry: RetryPolicy | None = None,
    ) -> None:
        self.path = path
        self.name = path.name
        self._align = align
        self._bandwidth = bandwidth
        self._pool = pool
        self._retry = retry
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._direct_fd = _open_direct(path) if io != "buffered" else -1
        self._direct_ok = self._direct_fd >= 0
        self.direct_frames = 0
        self._next_offset = 0
        self._end = 0
        self._frames: list[FrameRecord | None] = []
        self._started = time.monotonic()
        self._written = 0

    async def write(self, chunk: Chunk) -> int:
        """Write ``chunk`` as the next frame; returns its frame index."""
        payload = chunk.payload
        length = len(payload)
        index, offset = len(self._frames), self._next_offset
        self._frames.append(None)
        self._next_offset = -(-(offset + length) // self._align) * self._align
        self._end = max(self._end, offset + length)
        digest = None
        if self._can_write_direct(chunk, offset, length):
            try:
                digest = await run_blocking(
                    self._pool, _hash_and_write_direct, self._direct_fd, chunk.slab, length, offset
                )
                self.direct_frames += 1
            except OSError as exc:
                # The buffered path below writes this frame again, with its retries and error reporting.
                if exc.errno == errno.EINVAL:  # a block size or alignment O_DIRECT refuses: buffered from now on
                    self._direct_ok = False  # not closed: another worker may be writing through it
        if digest is None:
            where = f"writing {self.path} frame {index} at offset {offset}"
            retry = self._retry
            digest = await storage_call(self._pool, where, _hash_and_write, self._fd, payload, offset, retry=retry)
        self._frames[index] = FrameRecord(
            offset=offset,
            length=length,
            raw_length=len(chunk.raw),
            codec=chunk.codec,
            shuffle=chunk.shuffle,
            checksum=digest,
        )
        await self._throttle(length)
        return index

    def _can_write_direct(self, chunk: Chunk, offset: int, length: int) -> bool:
        """Raw bytes in a 4 KiB-aligned slab with room for the padded tail, at a 4 KiB-aligned offset."""
        slab = chunk.slab
        return (
            self._direct_ok
            and slab is not None
            and chunk.stored is None
            and offset % DIRECT_ALIGN == 0
            and slab.tensor.data_ptr() % DIRECT_ALIGN == 0
            and -(-length // DIRECT_ALIGN) * DIRECT_ALIGN <= slab.tensor.numel()
        )

    async def _throttle(self, length: int) -> None:
        """Keep the average write rate under the configured bandwidth (a share of a shared disk)."""
        self._written += length
        if self._bandwidth:
            ahead = self._written / self._bandwidth - (time.monotonic() - self._started)
            if ahead > 0:
                await asyncio.sleep(ahead)

    def finish(self) -> FileRecord:
        """Trim trailing alignment, fsync, close. Blocking: run it in an executor."""
        os.ftruncate(self._fd, self._end)
        faults.point("persist.fsync", self.path)
        os.fsync(self._fd)
        self.close()
        frames = [f for f in self._frames if f is not None]
        if len(frames) != len(self._frames):
            raise RuntimeError(f"{self.path}: finished with frames still being written")
        return FileRecord(size=self._end, frames=frames)

    def _close_direct(self) -> None:
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1

    def close(self) -> None:
        self._close_direct()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
