"""Copying a checkpoint's raw frames onto a target with O_DIRECT: read and hashed a block at a time, written
from that block, then read back from the device and hashed again.

Why: through the page cache, every byte a flush writes is first copied into fresh page-cache pages of the
target, and that copy is most of the flush's CPU. Measured on the 2-core VM of benchmarks/RESULTS.md, 305 MB
from a tmpfs to ext4: the buffered copy took 1.02 s of CPU (the source's verification 0.14 s, the read-back
0.06 s more), with O_DIRECT 0.20 s for reading, hashing and writing and 0.08 s for reading back and hashing.
On a node whose cores train, a flush's CPU is training time lost, wherever it runs (the node agent's
niced process included: the trainer lost ~1 s per 305 MB flush to it). And the read-back then checks what
the device returns, not the page cache.

Only a frame that needs nothing decoded to be checked (codec ``none``), lies at a 4 KiB-aligned offset, and
has no hole in the source goes this way: every byte written is one the source file really holds, so a
forged frame claiming gigabytes over a sparse hole still takes the buffered path, which verifies a frame
whole before writing any of it. Each block is hashed before it is written, and a frame whose checksum does
not match fails the copy, its bytes left in the target's partial directory (never published; a resumed copy
checks them against the checksum and copies them again). The last bytes of a frame past its last whole
4 KiB go through the buffered descriptor. A target without O_DIRECT (tmpfs before Linux 6.6, macOS), or one
that refuses it (EINVAL: a block size it does not take), leaves every frame to the buffered path.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import xxhash

from ..format.framefile import BLOCK, DIRECT_ALIGN, has_holes, write_fully
from ..format.records import FrameRecord
from ..reading.pieces import scatter_read
from ..reading.reader import CorruptCheckpointError
from ..storage.safeopen import reopen


class DirectFrames:
    """The O_DIRECT side of one target data file (open as ``dst`` at ``path``), and the aligned block its frames
    go through."""

    def __init__(self, dst: int, path: Path) -> None:
        self._dst = dst
        self._fd = -1
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            try:
                self._fd = reopen(dst, path, os.O_RDWR | flag)
            except OSError:  # a file system without O_DIRECT: EINVAL at open
                self._fd = -1
        self._block: mmap.mmap | None = None

    def takes(self, src: int, frame: FrameRecord) -> bool:
        """Whether ``frame`` of the source ``src`` is copied this way (see the module docstring)."""
        return (
            self._fd >= 0
            and frame.codec == "none"
            and frame.length > 0
            and frame.offset % DIRECT_ALIGN == 0
            and not has_holes(src, frame.offset, frame.length)
        )

    def copy(self, src: int, frame: FrameRecord, source: str) -> str | None:
        """Copy ``frame`` (named ``source`` in errors) from ``src``; the checksum of what the target returns when
        read back, or None if O_DIRECT was refused (nothing of this frame to trust: the caller copies it the
        buffered way, and so every later one). CorruptCheckpointError if the source's bytes do not match."""
        try:
            digest = self._hashed(frame, functools.partial(self._copy_block, src, source))
            if digest != frame.checksum:
                span = f"bytes {frame.offset}..{frame.offset + frame.length}"
                raise CorruptCheckpointError(
                    f"{source}: {span}: checksum mismatch (expected {frame.checksum}, got {digest}); not migrating it"
                )
            return self._hashed(frame, functools.partial(self._read_back, source))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.close()
            return None

    def _hashed(self, frame: FrameRecord, fill: Callable[[memoryview, int, int], None]) -> str:
        """The checksum of ``frame``'s bytes, a block at a time: ``fill(block, offset, aligned)`` puts the block's
        bytes at ``offset`` into ``block`` (its first ``aligned`` bytes a whole number of 4 KiB, the rest the
        frame's tail), then they are hashed."""
        if self._block is None:
            self._block = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants its buffer
        block = memoryview(self._block)
        hasher = xxhash.xxh3_64()
        offset, end = frame.offset, frame.offset + frame.length
        while offset < end:
            length = min(BLOCK, end - offset)
            fill(block[:length], offset, length - length % DIRECT_ALIGN)
            hasher.update(block[:length])
            offset += length
        return hasher.hexdigest()

    def _copy_block(self, src: int, source: str, block: memoryview, offset: int, aligned: int) -> None:
        """Read the block from the source, write it to the target: its whole 4 KiB with O_DIRECT, its tail buffered."""
        scatter_read(src, offset, [block], source)
        write_fully(self._fd, block[:aligned], offset)
        write_fully(self._dst, block[aligned:], offset + aligned)

    def _read_back(self, source: str, block: memoryview, offset: int, aligned: int) -> None:
        """Read the block back from the target: from the device with O_DIRECT, the tail through the descriptor
        that wrote it."""
        scatter_read(self._fd, offset, [block[:aligned]], source)
        scatter_read(self._dst, offset + aligned, [block[aligned:]], source)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._block is not None:
            self._block.close()
            self._block = None
