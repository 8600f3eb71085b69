"""The lowest reading layer: frames of data files -> verified bytes, scattered into byte buffers.

What a reader wants is pieces (byte ranges of stored items, each inside one frame's decoded
bytes); what is checksummed is frames. So every frame holding a wanted piece is read whole, once,
and its checksum recomputed from the bytes actually read before any of its pieces is handed on.
Uncompressed frames are read straight into the destination buffers with one scatter read
(``preadv``) and hashed in place, so reading costs one pass over the bytes.

Sizes in a manifest are claims, and a forged one (its checksum recomputed) must cost the reader
no more memory than the bytes really there. So, before anything is allocated for a frame: the file
must be as long as the frame's end; a frame with holes (a sparse file claims any size for free)
is verified first, its holes hashed as the zeros they read as; destination buffers are allocated
only when their first piece is about to be filled; the bytes of a frame between wanted pieces go
through one bounded block; and a compressed frame is decoded as a stream into the wanted pieces,
dropping every decoded byte past them, so a frame within zstd's ratio that claims gigabytes keeps
none of them (it is decoded to its end all the same: its stated length is checked, as verify checks
it). An allocation that fails is a :class:`ReadTooLargeError` naming what it was for.

Everything above (cutting shards, :mod:`tiers.reading.reshard`; decoding items, :mod:`tiers.reading.reader`;
format conversion) reads through :func:`read_pieces` into a :class:`ByteBuffers`.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
import torch
import xxhash

from tierstate.errors import TierstateError

from ..format.codecs import DECODE_BLOCK, CodecError, zstd_blocks
from ..format.framefile import feed_range, has_holes
from ..format.manifest import Manifest
from ..format.records import FrameRecord, ObjectRecord, Piece, TensorRecord
from ..storage.filesystem import TierError
from ..storage.safeopen import open_read
from .source import ByteSource, ShortReadError, as_source

IOV_MAX = 1024
K = TypeVar("K", bound=Hashable)


class CorruptCheckpointError(TierstateError, ValueError):
    """Bytes on disk do not match their checksum or cannot be decoded; names file and frame."""


class ReadTooLargeError(TierstateError, MemoryError):
    """The memory a checkpoint says an item needs cannot be allocated; names the item and the size."""


def allocate(shape: Sequence[int], dtype: torch.dtype, what: str) -> torch.Tensor:
    """``torch.empty(shape, dtype)``, or a ReadTooLargeError naming ``what`` it was for."""
    try:
        return torch.empty(tuple(shape), dtype=dtype)
    except (RuntimeError, MemoryError):
        nbytes = math.prod(shape) * dtype.itemsize
        raise ReadTooLargeError(f"{what}: cannot allocate the {nbytes} bytes the checkpoint says it holds") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable flat view (numpy refuses to cast an empty one)."""
    return tensor.numpy().data.cast("B") if tensor.numel() else memoryview(b"")


class PieceDestination(Protocol):
    """Where read pieces land: a writable view of exactly ``piece.length`` bytes per (key, piece)."""

    def view(self, key: Hashable, piece: Piece) -> memoryview: ...


class ByteBuffers:
    """One uint8 buffer per key, holding bytes ``[base, base + nbytes)`` of that key's stored item.

    The destination every reader fills: a whole item has base 0 and its full length; a window of
    an item (the bytes covering the box of a shard that a rank wants) starts at its first piece.
    A buffer is allocated when its first piece is about to be filled (its frame's bytes found on
    disk), not when it is declared, so a manifest's claims alone allocate nothing. Pieces of one
    frame may be filled by different threads; each has bytes of its own.
    """

    def __init__(self) -> None:
        self.bases: dict[Hashable, int] = {}
        self._sizes: dict[Hashable, tuple[int, str]] = {}
        self._tensors: dict[Hashable, torch.Tensor] = {}
        self._lock = threading.Lock()

    def add(self, key: Hashable, nbytes: int, base: int = 0, name: str | None = None) -> None:
        """Declare ``key``'s buffer; ``name`` says what it holds in errors (default: the key)."""
        self._sizes[key] = (nbytes, f"item {key!r}" if name is None else name)
        self.bases[key] = base

    def tensor(self, key: Hashable) -> torch.Tensor:
        with self._lock:
            if key not in self._tensors:
                nbytes, name = self._sizes[key]
                self._tensors[key] = allocate((nbytes,), torch.uint8, name)
            return self._tensors[key]

    @property
    def buffers(self) -> dict[Hashable, torch.Tensor]:
        """Every declared buffer (those no piece was read into, empty ones, allocated now)."""
        return {key: self.tensor(key) for key in self._sizes}

    def view(self, key: Hashable, piece: Piece) -> memoryview:
        start = piece.item_offset - self.bases[key]
        return tensor_bytes(self.tensor(key))[start : start + piece.length]


def _read_exact(fd: int, offset: int, length: int, where: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise CorruptCheckpointError(f"{where}: truncated (read {len(data)} of {length} bytes)")
    return data


def scatter_read(fd: int, offset: int, views: list[memoryview], where: str) -> None:
    """preadv into the destination views, in batches of IOV_MAX, handling short reads."""
    pending = [v for v in views if len(v)]
    while pending:
        batch = pending[:IOV_MAX]
        got = os.preadv(fd, batch, offset)
        if got == 0:
            raise CorruptCheckpointError(f"{where}: truncated")
        offset += got
        while got and pending:
            first = pending[0]
            if got >= len(first):
                got -= len(first)
                pending.pop(0)
            else:
                pending[0] = first[got:]
                got = 0


def check_frame(actual: str | None, frame: FrameRecord, where: str) -> None:
    if actual is None:
        raise CorruptCheckpointError(f"{where}: truncated")
    if actual != frame.checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch (expected {frame.checksum}, got {actual})")


def _disjoint(ordered: list[tuple[Hashable, Piece]], length: int) -> bool:
    """Whether the pieces (by offset) lie inside the frame without overlapping one another."""
    position = 0
    for _, piece in ordered:
        if piece.offset < position:
            return False
        position = piece.offset + piece.length
    return position <= length


def _read_in_place(
    fd: int, frame: FrameRecord, ordered: list[tuple[Hashable, Piece]], dest: PieceDestination, where: str
) -> str | None:
    """An uncompressed frame read straight into its disjoint pieces' views, the bytes between them
    through a bounded block; the checksum of all of it, in order (None if the file is shorter)."""
    hasher = xxhash.xxh3_64()
    position = 0
    run: list[memoryview] = []
    run_start = 0

    def read_run() -> None:
        scatter_read(fd, frame.offset + run_start, run, where)
        for view in run:
            hasher.update(view)
        run.clear()

    for key, piece in ordered:
        if piece.offset > position:  # bytes nobody wants: hashed, not kept
            read_run()
            if not feed_range(fd, frame.offset + position, piece.offset - position, hasher):
                return None
        if not run:
            run_start = piece.offset
        run.append(dest.view(key, piece))
        position = piece.offset + piece.length
    read_run()
    if position < frame.length and not feed_range(fd, frame.offset + position, frame.length - position, hasher):
        return None
    return hasher.hexdigest()


class _FrameScatter:
    """Puts a frame's decoded bytes, as they stream in, into the pieces wanted of it; keeps nothing else.

    With a byte shuffle of width ``w`` the stream is plane-major (every element's first byte, then
    every second byte, ...): plane ``j`` fills every ``w``-th byte of the frame from byte ``j``.
    """

    def __init__(self, ordered: list[tuple[Hashable, Piece]], dest: PieceDestination, frame: FrameRecord) -> None:
        wanted = [(p.offset, p.offset + p.length, key, p) for key, p in ordered if p.length]
        self._starts = [start for start, *_ in wanted]
        self._reach = list(accumulate((end for _, end, *_ in wanted), max))  # furthest end so far: monotone
        self._wanted = wanted
        self._dest = dest
        self._targets: dict[int, np.ndarray] = {}
        self.width = frame.shuffle
        self.plane = frame.raw_length // frame.shuffle
        last = self._reach[-1] if wanted else 0
        # The stream position after the last wanted byte (in the last plane): nothing past it is put anywhere.
        self.needed = (self.width - 1) * self.plane + (last - 1) // self.width + 1 if last else 0

    def _target(self, index: int) -> np.ndarray:
        if index not in self._targets:
            _, _, key, piece = self._wanted[index]
            self._targets[index] = np.frombuffer(self._dest.view(key, piece), dtype=np.uint8)
        return self._targets[index]

    def put(self, position: int, data: bytes | memoryview) -> None:
        """Stream bytes ``[position, position + len(data))`` of the frame's decoded bytes."""
        block = np.frombuffer(data, dtype=np.uint8)
        while len(block):
            plane, first = divmod(position, self.plane)
            count = min(len(block), self.plane - first)
            self._put_plane(plane, first, block[:count])
            block, position = block[count:], position + count

    def _put_plane(self, j: int, first: int, block: np.ndarray) -> None:
        """Elements ``first ..`` of plane ``j``: frame bytes ``e * w + j``."""
        w, stop = self.width, first + len(block)
        low, high = first * w + j, (stop - 1) * w + j + 1
        for index in range(bisect_left(self._reach, low + 1), bisect_left(self._starts, high)):
            start, end = self._wanted[index][:2]
            lo, hi = max(first, -(-(start - j) // w)), min(stop, -(-(end - j) // w))
            if lo < hi:
                at = lo * w + j - start
                self._target(index)[at : at + (hi - lo - 1) * w + 1 : w] = block[lo - first : hi - first]


class _StoredStream:
    """A frame's stored bytes read from its file as a stream, a block at a time: how a verified frame
    with holes is decoded without holding what it claims."""

    def __init__(self, fd: int, offset: int, length: int, where: str) -> None:
        self._fd, self._position, self._end, self._where = fd, offset, offset + length, where

    def read(self, size: int = -1, /) -> bytes:
        wanted = min(DECODE_BLOCK if size < 0 else size, self._end - self._position)
        data = _read_exact(self._fd, self._position, wanted, self._where)
        self._position += len(data)
        return data


def _decode_into(
    stored: bytes | _StoredStream, frame: FrameRecord, ordered: list[tuple[Hashable, Piece]], dest: PieceDestination
) -> None:
    """The verified stored bytes of a frame, decoded into the wanted pieces. A compressed frame is decoded to
    its end even when the pieces end sooner: it must decode to exactly the raw length it states, as verify
    and migrate require (a frame whose stated length was forged is refused, not half-read); the bytes past
    the pieces pass through one block and are dropped."""
    scatter = _FrameScatter(ordered, dest, frame)
    if frame.codec == "none":
        blocks = iter(lambda: stored.read(DECODE_BLOCK), b"") if isinstance(stored, _StoredStream) else [stored]
    else:
        blocks = zstd_blocks(stored, frame.raw_length)
    position = 0
    for block in blocks:
        if position < scatter.needed:
            scatter.put(position, block)
        position += len(block)


def decoding_problem(stored: int | bytes, frame: FrameRecord, where: str) -> str | None:
    """Why a frame whose stored bytes verified (in the file ``stored``, a descriptor, or already read)
    does not decode to the ``raw_length`` its record states, or None when it does: the check a restore
    makes on the bytes it decodes, run to the frame's end for verify and migrate (a re-signed zstd
    frame can state 1 KiB and expand to 4 GiB). Streaming: memory is one block, however far it expands."""
    if frame.codec == "none":
        return None
    source = _StoredStream(stored, frame.offset, frame.length, where) if isinstance(stored, int) else stored
    try:
        for _block in zstd_blocks(source, frame.raw_length):
            pass
    except CodecError as exc:
        return str(exc)
    return None


def unreadable(exc: OSError, where: str) -> TierError:
    return TierError(exc.errno, f"{where}: cannot read: {exc.strerror or exc}")


def _read_frame(
    fd: int, frame: FrameRecord, pieces: list[tuple[Hashable, Piece]], dest: PieceDestination, where: str
) -> None:
    """Read, verify and scatter one frame; a storage error (EIO, a directory in the file's place) is
    a TierError naming the file and frame."""
    try:
        _read_verified(fd, frame, pieces, dest, where)
    except TierstateError:
        raise
    except OSError as exc:
        raise unreadable(exc, where) from None


def _read_verified(
    fd: int, frame: FrameRecord, pieces: list[tuple[Hashable, Piece]], dest: PieceDestination, where: str
) -> None:
    end = frame.offset + frame.length
    size = os.fstat(fd).st_size
    if end > size:
        raise CorruptCheckpointError(f"{where}: truncated (the frame ends at byte {end}, the file has {size})")
    holes = has_holes(fd, frame.offset, frame.length)
    if holes:  # claimed, not held: verified (holes hashed, not read) before it costs any memory
        hasher = xxhash.xxh3_64()
        check_frame(hasher.hexdigest() if feed_range(fd, frame.offset, frame.length, hasher) else None, frame, where)
    ordered = sorted(pieces, key=lambda kp: kp[1].offset)
    if frame.codec == "none" and _disjoint(ordered, frame.length):
        check_frame(_read_in_place(fd, frame, ordered, dest, where), frame, where)
        return
    if holes:
        stored: bytes | _StoredStream = _StoredStream(fd, frame.offset, frame.length, where)
    else:  # every byte on disk: read once, verified, then decoded from memory
        stored = _read_exact(fd, frame.offset, frame.length, where)
        check_frame(xxhash.xxh3_64_hexdigest(stored), frame, where)
    try:
        _decode_into(stored, frame, ordered, dest)
    except CodecError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None


def read_pieces(
    location: Path | ByteSource,
    manifest: Manifest,
    wanted: Mapping[Hashable, Sequence[Piece]],
    dest: PieceDestination,
    workers: int = 4,
) -> int:
    """Read and verify every frame that holds a wanted piece, scattering the pieces into ``dest``.

    Frames are the unit of verification, so a frame is read whole even when only some of its
    bytes are wanted; each frame is read once however many pieces it holds. Returns the stored
    bytes read. A directory is read through file descriptors (scatter reads into the destination,
    holes checked); any other :class:`ByteSource` a frame at a time through ``read_into``, after the
    caller's admission checks (:func:`tiers.reading.integrity.admit`) bounded every frame by the bytes really stored.
    """
    by_frame: dict[tuple[str, int], list[tuple[Hashable, Piece]]] = defaultdict(list)
    for key, pieces in wanted.items():
        for piece in pieces:
            by_frame[(piece.file, piece.frame)].append((key, piece))
    source = as_source(location)
    with contextlib.ExitStack() as opened:
        directory = source.local_directory
        if directory is not None:  # file descriptors: scatter reads, holes checked
            fds = opened.enter_context(opened_files(directory, {file for file, _ in by_frame}))

            def read(file: str, frame: FrameRecord, pieces: list[tuple[Hashable, Piece]], where: str) -> None:
                _read_frame(fds[file], frame, pieces, dest, where)
        else:

            def read(file: str, frame: FrameRecord, pieces: list[tuple[Hashable, Piece]], where: str) -> None:
                _read_frame_from(source, file, frame, pieces, dest, where)

        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tierstate-read") as pool:
            futures = [
                pool.submit(
                    read, file, manifest.files[file].frames[frame], pieces, f"{source.where}/{file} frame {frame}"
                )
                for (file, frame), pieces in sorted(by_frame.items())
            ]
            for future in futures:
                future.result()
    return sum(manifest.files[file].frames[frame].length for file, frame in by_frame)


@contextlib.contextmanager
def opened_files(directory: Path, names: set[str]) -> Iterator[dict[str, int]]:
    """A read descriptor of each file in ``names``, closed afterwards; a missing one is a corrupt checkpoint."""
    fds: dict[str, int] = {}
    try:
        for name in names:
            try:
                fds[name] = open_read(directory / name)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{directory / name}: data file missing") from None
            except OSError as exc:
                raise unreadable(exc, str(directory / name)) from None
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_frame_from(
    source: ByteSource,
    file: str,
    frame: FrameRecord,
    pieces: list[tuple[Hashable, Piece]],
    dest: PieceDestination,
    where: str,
) -> None:
    """One frame of a non-directory source: its stored bytes read whole, verified, then decoded."""
    stored = bytearray(frame.length)
    try:
        source.read_into(file, frame.offset, memoryview(stored))
    except ShortReadError as exc:
        raise CorruptCheckpointError(f"{where}: truncated ({exc.strerror})") from None
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{source.where}/{file}: data file missing") from None
    except TierstateError:
        raise
    except OSError as exc:
        raise unreadable(exc, where) from None
    check_frame(xxhash.xxh3_64_hexdigest(stored), frame, where)
    try:
        _decode_into(bytes(stored), frame, sorted(pieces, key=lambda kp: kp[1].offset), dest)
    except CodecError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None


def read_records(
    location: Path | ByteSource,
    manifest: Manifest,
    records: Mapping[K, TensorRecord | ObjectRecord],
    workers: int = 4,
) -> dict[K, torch.Tensor]:
    """The stored bytes of each record, every frame verified on the way: key -> uint8 tensor of its own."""
    dest = ByteBuffers()
    for key, record in records.items():
        dest.add(key, manifest.record_nbytes(record))
    read_pieces(location, manifest, {key: record.pieces for key, record in records.items()}, dest, workers)
    buffers = dest.buffers  # built once: one lookup per record, not one dict per record
    return {key: buffers[key] for key in records}
