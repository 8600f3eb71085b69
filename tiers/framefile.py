"""Data files as checksummed frames: writing them at chosen offsets, and hashing them back.

A data file (``rank-N.data`` or ``rank-N.h5``) is a size and a list of frames, each a byte range
with a checksum; bytes outside every frame are zeros (alignment holes). Everything that writes,
copies or checks data files (persist, migration, format conversion, export, verify) goes through
these few functions, so they all agree on what "the same bytes" means.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import xxhash

from .format import FileRecord, FrameRecord, checksum

BLOCK = 8 << 20  # read granularity when hashing: large frames are hashed without allocating them whole


def write_frame(fd: int, data: bytes | memoryview, offset: int) -> str:
    """``pwrite`` all of ``data`` at ``offset``; the checksum of exactly the bytes handed to the kernel."""
    view = memoryview(data).cast("B")
    digest = checksum(view)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
    return digest


def hash_range(fd: int, offset: int, length: int) -> str | None:
    """Checksum of ``length`` bytes at ``offset``, read in blocks; None when the file is shorter."""
    hasher = xxhash.xxh3_64()
    buffer = bytearray(min(length, BLOCK))
    view = memoryview(buffer)
    remaining = length
    while remaining:
        got = os.preadv(fd, [view[: min(remaining, BLOCK)]], offset)
        if got == 0:
            return None
        hasher.update(view[:got])
        offset += got
        remaining -= got
    return hasher.hexdigest()


def align_up(value: int, align: int) -> int:
    return -(-value // align) * align


class FrameSink:
    """One data file being written as frames, from any number of threads at once.

    The caller chooses each frame's offset (HDF5 dataset addresses) or lets :meth:`append` pack
    them at aligned offsets (the frames format). Frames are recorded in the order they finish;
    the manifest allows any order as long as they do not overlap.
    """

    def __init__(self, path: Path, fd: int | None = None, align: int = 4096) -> None:
        self.path = path
        self.name = path.name
        self._fd = fd if fd is not None else os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._align = align
        self._lock = threading.Lock()
        self._frames: list[FrameRecord] = []
        self._next = 0

    def put(self, offset: int, data: bytes | memoryview) -> int:
        """Write ``data`` at ``offset`` as one frame; returns the frame's index."""
        digest = write_frame(self._fd, data, offset)
        return self._record(offset, len(memoryview(data).cast("B")), digest)

    def append(self, data: bytes | memoryview) -> int:
        """Write ``data`` as one frame at the next aligned offset; returns the frame's index."""
        length = len(memoryview(data).cast("B"))
        with self._lock:
            offset = self._next
            self._next = align_up(offset + length, self._align)
        return self.put(offset, data)

    def adopt(self, offset: int, length: int) -> int | None:
        """Record bytes already in the file (written by someone else, e.g. the HDF5 library) as a frame."""
        digest = hash_range(self._fd, offset, length)
        if digest is None:
            raise OSError(f"{self.path}: cannot read {length} bytes at {offset}: file too short")
        return self._record(offset, length, digest)

    def _record(self, offset: int, length: int, digest: str) -> int:
        frame = FrameRecord(offset=offset, length=length, raw_length=length, codec="none", checksum=digest)
        with self._lock:
            self._frames.append(frame)
            return len(self._frames) - 1

    @property
    def frames(self) -> list[FrameRecord]:
        return list(self._frames)

    def finish(self, size: int | None = None) -> FileRecord:
        """Set the size (default: the end of the last frame, trimming alignment), fsync, close."""
        end = max((f.offset + f.length for f in self._frames), default=0)
        size = end if size is None else size
        os.ftruncate(self._fd, size)
        os.fsync(self._fd)
        self.close()
        return FileRecord(size=size, frames=list(self._frames))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
