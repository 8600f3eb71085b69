"""The least any snapshotting asynchronous checkpointer must do on the CPU, as a method to compare with."""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from .checkpointer import BackgroundCheckpointer, Record
from .tensors import iter_tensors


class CopyFloorCheckpointer(BackgroundCheckpointer):
    """Not a checkpointer but the least any snapshotting asynchronous one must do on the CPU: copy
    the state once into preallocated host memory, on one background thread (numpy's single-threaded
    memcpy, as tierstate's capture), with no checksum and no I/O. Its slowdown is the floor against
    which tierstate's own overhead is read; its "durable after" is when the copy ended."""

    name = "copy-floor"

    def __init__(self, state: Any, root: Path) -> None:
        super().__init__(state, root)
        self._sources = [t.detach() for t in iter_tensors(state.state_dict())]
        self._buffers = [torch.zeros_like(t) for t in self._sources]  # zeros: pages faulted in now
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="copy-floor")
        self.setup = "one background thread, np.copyto of every tensor into a reused buffer; nothing written"

    def _copy(self, record: Record) -> None:
        for src, dst in zip(self._sources, self._buffers, strict=True):
            np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
        record.durable_at = time.perf_counter()

    def _save(self, record: Record) -> None:
        self.staged = self.durable = self._pool.submit(self._copy, record)  # copied: both at once

    def close(self) -> None:
        self.drain()
        self._pool.shutdown()


def host_buffers(sources: list[torch.Tensor]) -> list[np.ndarray]:
    """A page-aligned (O_DIRECT-ready), faulted-in byte buffer per source tensor, reused by every copy."""
    buffers = [np.frombuffer(mmap.mmap(-1, t.numel() * t.element_size()), dtype=np.uint8) for t in sources]
    for buffer in buffers:
        buffer[:] = 0
    return buffers


def memcpy_all(sources: list[torch.Tensor], buffers: list[np.ndarray]) -> None:
    """The bare memcpy of the state: one ``np.copyto`` per tensor (one thread, GIL released)."""
    for src, dst in zip(sources, buffers, strict=True):
        _memcpy(src, dst)


def _memcpy(src: torch.Tensor, dst: np.ndarray) -> None:
    np.copyto(dst, src.detach().reshape(-1).view(torch.uint8).numpy())


def copy_write_fsync(
    sources: list[torch.Tensor], buffers: list[np.ndarray], path: Path, direct: bool = False, hashed: bool = False
) -> None:
    """The plain-thread floor of a checkpoint: memcpy the state, (``hashed``: xxh3 of each buffer, as
    tierstate checksums every frame), write it to ``path`` (buffered, or O_DIRECT as tierstate writes), fsync."""
    memcpy_all(sources, buffers)
    if hashed:
        for buffer in buffers:
            xxhash.xxh3_64_hexdigest(buffer)
    write_fsync(buffers, path, direct)


def copy_hash_then_write_overlapped(sources: list[torch.Tensor], buffers: list[np.ndarray], path: Path) -> None:
    """The floor's work (memcpy, xxh3, O_DIRECT write, fsync) in tierstate's default shape: this thread
    copies and checksums each buffer and hands it to a second plain thread, which writes it while the
    next one is copied. What overlapping copy and write costs, without any of tierstate's own code."""
    handed: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=2)
    failed: list[OSError] = []  # the writer's error, raised here; it keeps taking buffers so put() never hangs
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)

    def writer() -> None:
        offset = 0
        while (buffer := handed.get()) is not None:
            if not failed:
                try:
                    offset += os.pwrite(fd, memoryview(buffer), offset)
                except OSError as exc:
                    failed.append(exc)

    thread = threading.Thread(target=writer, name="floor-writer")
    thread.start()
    try:
        for src, dst in zip(sources, buffers, strict=True):
            _memcpy(src, dst)
            xxhash.xxh3_64_hexdigest(dst)
            handed.put(dst)
    finally:
        handed.put(None)
        thread.join()
    try:
        if failed:
            raise failed[0]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_fsync(buffers: list[np.ndarray], path: Path, direct: bool = False) -> None:
    """Write ``buffers`` (page-aligned sizes for ``direct``) one after another to ``path``, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for buffer in buffers:
            view = memoryview(buffer)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class SharedCopyFloor:
    """The copy floor of a restart (benchmarks/recovery.py): each checkpoint is one memcpy of every tensor, on
    one background thread, into shared memory that outlives the process and is reused (a file in a tmpfs,
    allocated and mapped once, holding two slots so the newest committed one is never overwritten), then a
    commit record (step, slot) replaced whole; a restart copies the bytes straight back into its tensors. No
    checksum, no disk, no format: the physical limit of checkpointing into memory."""

    def __init__(self, tensors: list[torch.Tensor], directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._tensors = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
        self._slot_bytes = sum(t.numel() for t in self._tensors)
        size = 2 * self._slot_bytes
        fd = os.open(directory / "slots", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # every page allocated before one is touched: never a SIGBUS
            self._mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._mapping, dtype=np.uint8)
        self._record = directory / "committed"
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="copy-floor")
        self._next = 0

    def save(self, step: int) -> concurrent.futures.Future[None]:
        """Copy the tensors into the slot not committed, in the background; done once committed."""
        slot, self._next = self._next, self._next ^ 1
        return self._pool.submit(self._copy, step, slot)

    def _copy(self, step: int, slot: int) -> None:
        at = slot * self._slot_bytes
        for tensor in self._tensors:
            np.copyto(self._bytes[at : at + tensor.numel()], tensor.numpy())
            at += tensor.numel()
        staged = self._record.with_name("committed.new")
        staged.write_text(f"{step} {slot}")
        os.replace(staged, self._record)  # a kill before this leaves the older slot the committed one

    def restore(self) -> int:
        """The committed slot's bytes into the tensors; its step."""
        step, slot = (int(x) for x in self._record.read_text().split())
        at = slot * self._slot_bytes
        for tensor in self._tensors:
            np.copyto(tensor.numpy(), self._bytes[at : at + tensor.numel()])
            at += tensor.numel()
        return step

    def close(self) -> None:
        self._pool.shutdown()
