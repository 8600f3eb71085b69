"""A memory tier's data files as capture's destination: preallocated, mapped once, reused by every checkpoint.

Written the usual way, a checkpoint into a tmpfs costs the trainer about ten copies' worth of a
memcpy: its bytes copied into a host-cache slab, then by the kernel into fresh tmpfs pages (a page
fault per 4 KiB), and the older checkpoint's pages freed. Here each rank's data file *is* the
destination: a :class:`SlotPool` hands a checkpoint a file whose pages are allocated
(``posix_fallocate``) and mapped (``MAP_POPULATE``; with CUDA registered as pinned memory, so a GPU
tensor reaches it by DMA), capture copies each tensor into the mapping at the offset its frame will
have, and the file is committed where it lies by the usual protocol (manifest last, rename). When
retention deletes an older step its data file comes back to the pool (tiers/storage/slotdirs.py), so
the pages are never freed and never faulted in again; the mapping is kept by file identity (device,
inode) and reused while the file keeps its size.

A slot being written is never a committed checkpoint: the pool hands out only files in its own
directory (returned by retention, or new), never one a ``step-N`` holds; the newest committed
checkpoint's file therefore cannot be the one being overwritten, whatever ``keep_last`` is.

Never a SIGBUS: a page of the mapping is touched only once the file is allocated over the whole
mapped length (``posix_fallocate`` succeeded, after ``statvfs`` said there was room), so a full tmpfs
fails the checkpoint with ENOSPC naming the tier, never the trainer with a signal.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from .filesystem import TierError
from .safeopen import create_new, make_dir, open_existing
from .slotdirs import free_files, free_name, pool_dir, pools_dir

log = logging.getLogger("tierstate")

PAGE = mmap.PAGESIZE
_SPARE = 1  # free files a pool keeps beyond the one taken: more come back only when more steps were deleted
Key = tuple[int, int]  # (st_dev, st_ino): a file's identity, whatever its name


def allocated(fd: int) -> int:
    """The bytes the file open as ``fd`` has allocated (holes are not)."""
    return os.fstat(fd).st_blocks * 512


class Slot:
    """One data file, mapped over ``size`` bytes: ``tensor`` (uint8) is where capture writes."""

    def __init__(self, fd: int, size: int, key: Key, pin: bool) -> None:
        self.fd = fd
        self.size = size
        self.key = key
        # Only after the whole length is allocated: a page of a shared mapping that cannot be allocated
        # when touched is a SIGBUS. MAP_POPULATE fills the page tables once, not a fault per page later.
        self._mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.pinned = pin and _register(self.tensor)

    @property
    def gone(self) -> bool:
        """Whether the file was unlinked (by gc, a prune without a pool): only this mapping still holds it."""
        return os.fstat(self.fd).st_nlink == 0

    def release(self) -> None:
        """Unmap and close; the file itself stays where it is."""
        if self.pinned:
            _cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        del self.tensor
        try:
            self._mapping.close()
        except BufferError:
            pass  # a view of it is still alive (a failed checkpoint's error holding a chunk): unmapped with it
        os.close(self.fd)


def _register(tensor: torch.Tensor) -> bool:
    """Page-lock the mapping for DMA from a GPU (cudaHostRegister); False without CUDA or when refused
    (RLIMIT_MEMLOCK): capture then copies through the driver's staging, slower, never wrong."""
    if not torch.cuda.is_available():
        return False
    cudart = _cudart()
    result = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if result != cudart.cudaError.success:
        log.warning("memory tier: cudaHostRegister of a %d-byte slot failed (%s): GPU copies into it are not "
                    "DMA", tensor.numel(), result)  # fmt: skip
        return False
    return True


def _cudart() -> Any:
    """torch's bindings of the CUDA runtime (loaded whenever CUDA is available)."""
    cudart = torch.cuda.cudart()
    if cudart is None:
        raise RuntimeError("torch.cuda.cudart() is unavailable although CUDA is")
    return cudart


class SlotPool:
    """Rank ``rank``'s slots in the memory tier ``tier`` at ``root``; ``keep``: how many checkpoints the tier
    keeps (so how many mappings are worth keeping); ``pin``: register mappings with CUDA where there is one."""

    def __init__(self, tier: str, root: Path, rank: int, keep: int, pin: bool) -> None:
        self.tier = tier
        self.directory = pool_dir(root, rank)
        self._pools = pools_dir(root)
        self._pin = pin
        self._mapped: OrderedDict[Key, Slot] = OrderedDict()  # least recently taken first
        self._most = keep + 2  # the kept checkpoints', the one being written, a spare
        self._lock = threading.Lock()
        self._make_dirs()

    def _make_dirs(self) -> None:
        """The pool's directories, each a real one (a symlink there is refused); its existence tells retention to
        return this rank's files (slotdirs.py)."""
        for directory in (self._pools, self.directory):
            make_dir(directory)

    def take(self, size: int, target: Path) -> Slot:
        """A slot of ``size`` bytes (a multiple of the page size), allocated and mapped, its file renamed to
        ``target`` (this rank's data file in a fresh partial directory). TierError (ENOSPC, naming the tier)
        when the file system has no room for it."""
        with self._lock:
            self._forget_gone()
            self._make_dirs()  # again: someone may have removed the tier's directory since (it is theirs too)
            free = free_files(self.directory)
            # A file mapped at this size already costs nothing; any other known one saves the mapping's setup.
            free.sort(key=lambda e: self._rank_of(e.inode(), size))
            slot, name = None, self.directory / free_name()
            for entry in free:
                try:
                    fd = open_existing(Path(entry.path))
                except OSError:
                    continue  # taken away meanwhile, or no regular file after all: not ours to use
                slot, name = self._ready(fd, size), Path(entry.path)
                break
            if slot is None:  # none free: a new file, under the fresh name
                slot = self._ready(create_new(name, os.O_RDWR, 0o600), size)
            os.rename(name, target)
            self._mapped.move_to_end(slot.key)
            self._trim(free, name)
            return slot

    def reusable(self, size: int) -> int:
        """The bytes of a ``size``-byte slot that a free file of the pool already holds (allocated: taking it
        adds only the rest to what the tier takes)."""
        held = 0
        for entry in free_files(self.directory):
            try:
                held = max(held, entry.stat(follow_symlinks=False).st_blocks * 512)
            except FileNotFoundError:
                continue  # removed meanwhile
        return min(held, size)

    def put_back(self, slot: Slot, path: Path) -> None:
        """After a failed checkpoint: its data file at ``path`` back into the pool (if it is still that file)."""
        with self._lock:
            try:
                seen = os.lstat(path)
                if (seen.st_dev, seen.st_ino) == slot.key:
                    os.rename(path, self.directory / free_name())
            except FileNotFoundError:
                pass  # removed with its partial directory already: the mapping goes at the next take

    def close(self) -> None:
        """Unmap every slot, delete the free files (their memory is the node's again) and the pool directory,
        so retention unlinks from now on. Committed checkpoints keep their files."""
        with self._lock:
            for slot in self._mapped.values():
                slot.release()
            self._mapped.clear()
            for entry in free_files(self.directory):
                os.unlink(entry.path)
            for directory in (self.directory, self._pools):
                try:
                    directory.rmdir()
                except OSError:
                    break  # a file returned meanwhile, or another rank's pool: left for the next writer

    @property
    def mapped(self) -> int:
        """How many files this pool keeps mapped (its own free ones and the committed checkpoints')."""
        return len(self._mapped)

    def _rank_of(self, inode: int, size: int) -> int:
        known = [slot for slot in self._mapped.values() if slot.key[1] == inode]
        return 0 if known and known[0].size == size else 1 if known else 2

    def _ready(self, fd: int, size: int) -> Slot:
        """The file open as ``fd`` (this pool's now) at exactly ``size`` bytes, allocated and mapped; ``fd`` is
        the slot's from then on, or closed."""
        try:
            stat = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        key = (stat.st_dev, stat.st_ino)
        known = self._mapped.get(key)
        if known is not None and known.size == size and allocated(known.fd) >= size:
            os.close(fd)
            if os.fstat(known.fd).st_size != size:
                os.ftruncate(known.fd, size)  # a committed file ends at its last frame; objects go past it
            return known
        if known is not None:
            del self._mapped[key]
            known.release()  # another size: mapped again below
        try:
            os.ftruncate(fd, size)  # shrinking frees the tail now; growing leaves a hole until allocated
            # Always, for a file not mapped at this size by this pool: one written another way (an older
            # step's) may hold holes between its frames even when it has as many blocks as the slot needs.
            self._allocate(fd, size)
            slot = Slot(fd, size, key, self._pin)
        except BaseException:
            os.close(fd)
            raise
        self._mapped[key] = slot
        return slot

    def _allocate(self, fd: int, size: int) -> None:
        missing = size - allocated(fd)
        stat = os.fstatvfs(fd)
        free = stat.f_bavail * stat.f_frsize
        problem = None
        if free < missing:
            problem = f"needs {missing} more bytes for this rank's slot ({size} in all), its file system has {free}"
        else:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                problem = f"cannot allocate this rank's {size}-byte slot: {exc.strerror or exc}"
        if problem is not None:
            raise TierError(
                errno.ENOSPC,
                f"tier {self.tier}: {problem} ({self.directory}); other processes fill that file system too: "
                f"give it more room or lower tiers.{self.tier}.size",
            )

    def _forget_gone(self) -> None:
        """Unmap files unlinked behind the pool's back: their memory stays taken while mapped."""
        for key in [key for key, slot in self._mapped.items() if slot.gone]:
            self._mapped.pop(key).release()

    def _trim(self, free: list[os.DirEntry[str]], taken: Path) -> None:
        """Unlink free files beyond the spare (more steps were deleted than a checkpoint needs back), and unmap
        the least recently taken beyond what the tier can hold."""
        left = [entry for entry in free if entry.path != str(taken)]
        for entry in left[_SPARE:]:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
        while len(self._mapped) > self._most:
            _, slot = self._mapped.popitem(last=False)
            slot.release()
