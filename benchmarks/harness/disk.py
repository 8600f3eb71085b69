"""The disk's own limits, measured in the same run as the methods: sequential write and read seconds.

The directory fsync is the library's own (``fsync_dir``), so the probe commits a file exactly as
tierstate does; it is the benchmarks' only import of a tierstate module outside the public API
besides the ones a script measures on purpose (codecs, migrate).
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from tierstate.tiers.storage.filesystem import fsync_dir

from .machine import write_kernel_knob
from .units import MiB

__all__ = ["disk_read_seconds", "disk_write_seconds", "drop_caches", "fsync_dir", "settle"]


def settle() -> None:
    """Write back other dirty pages first, so one method's writeback is not billed to the next."""
    os.sync()


def drop_caches() -> bool:
    """Empty the page cache for cold reads; False where not permitted (not root, in a container)."""
    os.sync()
    return write_kernel_knob("/proc/sys/vm/drop_caches", "3")


def _random_block(nbytes: int) -> mmap.mmap:
    """A page-aligned (O_DIRECT-ready) block of random bytes, so no layer can compress or dedupe it."""
    block = mmap.mmap(-1, nbytes)
    block.write(os.urandom(nbytes))
    return block


def disk_write_seconds(path: Path, nbytes: int, direct: bool, block_size: int = 64 * MiB) -> float:
    """Seconds to write ``nbytes`` sequentially to a new file and fsync it (O_DIRECT or buffered)."""
    block = _random_block(block_size)
    nbytes = -(-nbytes // 4096) * 4096  # O_DIRECT writes whole 4 KiB blocks
    path.unlink(missing_ok=True)
    settle()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    started = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        offset = 0
        with memoryview(block) as view:
            while offset < nbytes:
                offset += os.pwrite(fd, view[: min(block_size, nbytes - offset)], offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    elapsed = time.perf_counter() - started
    block.close()
    return elapsed


def disk_read_seconds(path: Path, direct: bool, block_size: int = 64 * MiB) -> float:
    """Seconds to read ``path`` sequentially: cold page cache (dropped first) or O_DIRECT."""
    block = mmap.mmap(-1, block_size)
    if not direct:
        drop_caches()
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        offset = 0
        while got := os.preadv(fd, [block], offset):
            offset += got
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - started
    block.close()
    return elapsed
