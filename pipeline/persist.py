"""Writing frames into one rank's data file: offsets reserved in order, writes run concurrently.

Each chunk becomes one frame at an aligned offset (holes between frames read back as zeros), so
several persist workers can ``pwrite`` at once without a lock around the file. The checksum is
computed from the very bytes handed to the kernel, in the same worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from pathlib import Path

from pipeline.units import Chunk, run_blocking
from tiers.format import FileRecord, FrameRecord, checksum


def _hash_and_write(fd: int, data: memoryview | bytes, offset: int) -> str:
    view = memoryview(data).cast("B")
    digest = checksum(view)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
    return digest


class FrameWriter:
    def __init__(self, path: Path, align: int, bandwidth: int | None, pool: concurrent.futures.Executor) -> None:
        self.path = path
        self.name = path.name
        self._align = align
        self._bandwidth = bandwidth
        self._pool = pool
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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
        digest = await run_blocking(self._pool, _hash_and_write, self._fd, payload, offset)
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
        os.fsync(self._fd)
        self.close()
        frames = [f for f in self._frames if f is not None]
        if len(frames) != len(self._frames):
            raise RuntimeError(f"{self.path}: finished with frames still being written")
        return FileRecord(size=self._end, frames=frames)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
