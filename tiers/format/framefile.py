"""Data files as checksummed frames: the one frame writer, and hashing frames back.

A data file (``rank-N.data`` or ``rank-N.h5``) is a size and a list of frames, each a byte range
with a checksum; in a frames file the bytes outside every frame are zeros (alignment holes).
Everything that writes, copies or checks data files (persist, migration, format conversion,
export, verify) goes through this module, so they all agree on what "the same bytes" means.

:class:`FrameFile` is the only code that writes frames. As the frames container it stores each
chunk as one frame at the next ``align`` boundary; the HDF5 container uses it to put frames at its
datasets' addresses and to checksum the bytes the HDF5 library wrote itself. Offsets are reserved
in order and writes run concurrently, so several threads can ``pwrite`` at once without a lock
around the file; each checksum is either the one capture took of the chunk (stored as is, so bytes
changed since fail verification) or computed from the very bytes handed to the kernel.

Raw frames still in their host-cache slab are written with ``O_DIRECT`` where the file system
allows it (``io="auto"``): a buffered write first copies every byte into the page cache and the
final fsync then waits for all of it, which measured ~0.6 GB/s on a disk that takes ~1.5-2.3 GB/s
O_DIRECT (benchmarks/RESULTS.md); direct writes go from the slab to the device, cost no CPU copy
and leave no checkpoint-sized page cache behind. The slab is 4 KiB aligned and frames start at
``align`` boundaries, so only the tail up to the next 4 KiB is padded (zeros, trimmed at finish).
Compressed and object frames (arbitrary Python buffers) are written buffered through a second
descriptor; one fsync at the end covers both.

Fault points (:mod:`tiers.storage.faults`): ``persist.write`` before each frame write, ``persist.fsync``
before the fsync.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import xxhash

from ..storage import faults
from ..storage.hostcache import Slab
from ..storage.safeopen import create_new, open_existing, reopen
from .container import Chunk, ItemPiece
from .format import checksum, piece_body
from .records import FileRecord, FrameRecord

BLOCK = 8 << 20  # read granularity when hashing: large frames are hashed without allocating them whole
DIRECT_ALIGN = 4096  # O_DIRECT needs buffer, offset and length aligned to the logical block size (<= 4 KiB)


def align_up(value: int, align: int) -> int:
    return -(-value // align) * align


def write_fully(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` every byte of ``view`` at ``offset``, however many calls the kernel takes (a short write is
    no error). The one such loop: persist, migration and the O_DIRECT copy all write through it."""
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    faults.point("persist.write")  # persist's writes only: the kill tests count these
    write_fully(fd, view, offset)


def _hash_and_write(fd: int, data: bytes | memoryview, offset: int, known: str | None = None) -> str:
    """``pwrite`` all of ``data`` at ``offset``; its checksum: ``known`` (taken when the bytes were
    captured, stored as is) or else computed from exactly the bytes handed to the kernel."""
    view = memoryview(data).cast("B")
    digest = known or checksum(view)
    _write_all(fd, view, offset)
    return digest


def _hash_and_write_direct(fd: int, slab: Slab, length: int, offset: int, known: str | None) -> str:
    """Write the slab's first ``length`` bytes with O_DIRECT, zero-padded to the next 4 KiB."""
    padded = align_up(length, DIRECT_ALIGN)
    if padded > length:
        slab.tensor[length:padded].zero_()  # no stale bytes of an earlier checkpoint on disk
    digest = known or checksum(slab.view(length))
    _write_all(fd, slab.view(padded), offset)
    return digest


def _open_direct(fd: int, path: Path) -> int:
    """A second, O_DIRECT descriptor on the file open as ``fd``, or -1 where the OS or file system has
    none (tmpfs, macOS) or ``path`` no longer names that file."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return reopen(fd, path, os.O_WRONLY | flag)
    except OSError:
        return -1


def _next_data(fd: int, offset: int, end: int) -> int:
    """Where the file's data resumes at or after ``offset`` (``end`` at most): beyond ``offset`` only
    across a hole of a sparse file. Without SEEK_DATA support everything counts as data."""
    try:
        return min(os.lseek(fd, offset, os.SEEK_DATA), end)
    except OSError as exc:
        return end if exc.errno == errno.ENXIO else offset  # ENXIO: only a hole up to the end of the file


def _next_hole(fd: int, offset: int, end: int) -> int:
    try:
        return min(os.lseek(fd, offset, os.SEEK_HOLE), end)
    except OSError:
        return end


def has_holes(fd: int, offset: int, length: int) -> bool:
    """Whether ``length`` bytes at ``offset`` include a hole: bytes a sparse file claims without holding.

    Frames are written, never seeked over, so their bytes are normally all data; a hole inside one
    means the size was claimed for nothing (or a file system stored zeros as holes), and a reader
    checks such a frame before allocating anything on its word.
    """
    end = offset + length
    return length > 0 and (_next_data(fd, offset, end) > offset or _next_hole(fd, offset, end) < end)


_ZEROS = memoryview(bytes(BLOCK))  # what a hole reads as (calloc'd: costs no memory until hashed from)


def feed_range(fd: int, offset: int, length: int, hasher: xxhash.xxh3_64, buffer: memoryview | None = None) -> bool:
    """Feed ``length`` bytes at ``offset`` to ``hasher``, read in blocks; False when the file is shorter.

    A hole of a sparse file is fed as the zeros it reads as, without reading it: a forged size of
    many gigabytes over a small sparse file costs hashing, never I/O or memory. ``buffer`` is the
    block to read through (a caller's own, reused: small enough to stay in cache), else one of
    up to BLOCK bytes is allocated.
    """
    end = offset + length
    if end > os.fstat(fd).st_size:
        return False
    while offset < end:
        data = _next_data(fd, offset, end)
        while offset < data:
            step = min(BLOCK, data - offset)
            hasher.update(_ZEROS[:step])
            offset += step
        hole = _next_hole(fd, offset, end)
        if hole <= offset:  # the file changed between the two seeks: read on
            hole = end
        while offset < hole:
            if buffer is None:
                buffer = memoryview(bytearray(min(BLOCK, length)))
            got = os.preadv(fd, [buffer[: min(len(buffer), hole - offset)]], offset)
            if got == 0:
                return False
            hasher.update(buffer[:got])
            offset += got
    return True


def hash_range(fd: int, offset: int, length: int) -> str | None:
    """Checksum of ``length`` bytes at ``offset`` (holes hashed, not read); None when the file is shorter."""
    hasher = xxhash.xxh3_64()
    return hasher.hexdigest() if feed_range(fd, offset, length, hasher) else None


class FrameFile:
    """One data file being written as frames, from any number of threads at once.

    ``create=True`` makes a new frames file (refused if anything has its name); ``create=False``
    opens the regular file another writer made (the HDF5 library, a memory tier's slot), to put frames
    into it; ``start`` is where :meth:`write` puts its first frame (after the frames a slot holds).
    ``io="buffered"`` never opens the O_DIRECT descriptor. Each frame's index and offset are
    reserved when its write starts, so the frame list is in reservation order; a write that raised
    and is repeated (a retry) reuses its reservation.
    """

    def __init__(
        self, path: Path, align: int = 4096, io: str = "auto", *, create: bool = True, start: int = 0
    ) -> None:
        self.path = path
        self.name = path.name
        self._align = align
        # Never through a symlink or into anything but a regular file (see tiers.storage.safeopen).
        self._fd = create_new(path) if create else open_existing(path, os.O_RDWR)
        self._direct_fd = _open_direct(self._fd, path) if io != "buffered" else -1
        # A padded direct write must end before the next frame begins: frames start at 4 KiB boundaries.
        self._direct_ok = self._direct_fd >= 0 and align % DIRECT_ALIGN == 0
        self.direct_frames = 0
        self._lock = threading.Lock()
        self._frames: list[FrameRecord | None] = []
        self._pending: dict[int, tuple[Chunk, int, int]] = {}  # id(chunk) -> (chunk, index, offset) until written
        self._placed: dict[int, int] = {}  # offset -> index of frames put at a caller's offset
        self._next = start  # where :meth:`write` puts its first frame
        self._end = 0

    # --- the frames container ---------------------------------------------------------------------
    def write(self, chunk: Chunk) -> list[ItemPiece]:
        """Store ``chunk`` as one frame at the next ``align`` boundary; its entries are pieces of that frame."""
        payload = chunk.payload
        length = len(payload)
        index, offset = self._reserve(chunk, length)
        digest = None
        slab = self._direct_slab(chunk, offset, length)
        if slab is not None:
            digest = self._write_direct(chunk, slab, length, offset)
        if digest is None:
            digest = self._write_at(index, offset, payload, chunk.payload_checksum)
        record = FrameRecord(
            offset=offset,
            length=length,
            raw_length=len(chunk.raw),
            codec=chunk.codec,
            shuffle=chunk.shuffle,
            checksum=digest,
        )
        with self._lock:
            self._frames[index] = record
            del self._pending[id(chunk)]
        return [(e.key, piece_body(self.name, index, e.chunk_offset, e.length, e.item_offset)) for e in chunk.entries]

    def _reserve(self, chunk: Chunk, length: int) -> tuple[int, int]:
        """The next aligned offset and frame index for ``chunk``; the same ones again on a retry."""
        with self._lock:
            pending = self._pending.get(id(chunk))
            if pending is not None:
                return pending[1], pending[2]
            offset = self._next
            self._next = align_up(offset + length, self._align)
            index = self._new_slot(offset, length)
            self._pending[id(chunk)] = (chunk, index, offset)  # holding the chunk keeps its id unique
            return index, offset

    def _direct_slab(self, chunk: Chunk, offset: int, length: int) -> Slab | None:
        """The chunk's slab if it can be written with O_DIRECT (raw bytes in a 4 KiB-aligned slab with room for
        the padded tail, at a 4 KiB-aligned offset), else None."""
        slab = chunk.slab
        if (
            self._direct_ok
            and slab is not None
            and chunk.stored is None
            and offset % DIRECT_ALIGN == 0
            and slab.tensor.data_ptr() % DIRECT_ALIGN == 0
            and align_up(length, DIRECT_ALIGN) <= slab.tensor.numel()
        ):
            return slab
        return None

    def _write_direct(self, chunk: Chunk, slab: Slab, length: int, offset: int) -> str | None:
        """The frame (``chunk``'s raw bytes in ``slab``) written with O_DIRECT, its checksum; None if refused
        (then it goes buffered)."""
        try:
            digest = _hash_and_write_direct(self._direct_fd, slab, length, offset, chunk.payload_checksum)
        except OSError as exc:
            # The buffered descriptor writes this frame again; its failures are the ones reported.
            if exc.errno == errno.EINVAL:  # a block size or alignment O_DIRECT refuses: buffered from now on
                self._direct_ok = False  # not closed: another thread may be writing through it
            return None
        with self._lock:
            self.direct_frames += 1
        return digest

    # --- frames at the caller's offsets (HDF5 datasets) -------------------------------------------
    def put(self, offset: int, data: bytes | memoryview) -> int:
        """Write ``data`` (not empty) at ``offset`` as one frame; its index. Repeated at the same
        offset (a retry), it is the same frame."""
        view = memoryview(data).cast("B")
        index = self._place(offset, len(view))
        self._fill(index, offset, len(view), self._write_at(index, offset, view))
        return index

    def adopt(self, offset: int, length: int) -> int:
        """Record bytes already in the file (written by someone else, e.g. the HDF5 library) as a frame."""
        digest = hash_range(self._fd, offset, length)
        if digest is None:
            raise OSError(f"{self.path}: cannot read {length} bytes at {offset}: file too short")
        index = self._place(offset, length)
        self._fill(index, offset, length, digest)
        return index

    # --- frames whose bytes are in the file already (a memory tier's slot: tiers/format/slotfile.py) --
    def reserve(self, offset: int, length: int) -> int:
        """The index of the frame of ``length`` bytes at ``offset``, to be :meth:`record`-ed before :meth:`finish`
        (which fails on a frame never recorded); the same index for the same offset."""
        return self._place(offset, length)

    def record(self, offset: int, length: int, digest: str) -> int:
        """Record bytes someone else put at ``offset`` (capture, through the file's mapping) as one frame whose
        checksum ``digest`` was taken from exactly those bytes; its index."""
        index = self._place(offset, length)
        self._fill(index, offset, length, digest)
        return index

    def _place(self, offset: int, length: int) -> int:
        with self._lock:
            index = self._placed.get(offset)
            if index is None:
                index = self._placed[offset] = self._new_slot(offset, length)
            return index

    def _fill(self, index: int, offset: int, length: int, digest: str) -> None:
        record = FrameRecord(offset=offset, length=length, raw_length=length, codec="none", checksum=digest)
        with self._lock:
            self._frames[index] = record

    @property
    def frames(self) -> list[FrameRecord]:
        """The frames written so far, in order of offset."""
        with self._lock:
            return sorted((f for f in self._frames if f is not None), key=lambda f: f.offset)

    # --- shared -----------------------------------------------------------------------------------
    def _new_slot(self, offset: int, length: int) -> int:
        """A frame index for bytes about to be written; call with the lock held."""
        self._frames.append(None)
        self._end = max(self._end, offset + length)
        return len(self._frames) - 1

    def _write_at(self, index: int, offset: int, data: bytes | memoryview, known: str | None = None) -> str:
        try:
            return _hash_and_write(self._fd, data, offset, known)
        except OSError as exc:
            exc.add_note(f"frame {index} at offset {offset}")  # where in the file: the caller names the file
            raise

    def file_size(self) -> int:
        """The size of the file as it is now (including what others wrote into it)."""
        return os.fstat(self._fd).st_size

    def finish(self, size: int | None = None) -> FileRecord:
        """Set the size (default: the end of the last frame, trimming alignment padding), fsync, close."""
        with self._lock:
            frames = list(self._frames)
        written = [f for f in frames if f is not None]
        if len(written) != len(frames):
            raise RuntimeError(f"{self.path}: finished with frames still being written")
        size = self._end if size is None else size
        os.ftruncate(self._fd, size)
        faults.point("persist.fsync", self.path)
        os.fsync(self._fd)
        self.close()
        return FileRecord(size=size, frames=written)

    def close(self) -> None:
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
