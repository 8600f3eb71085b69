"""The lowest reading layer: frames of data files -> verified bytes, scattered into byte buffers.

What a reader wants is pieces (byte ranges of stored items, each inside one frame's decoded
bytes); what is checksummed is frames. So every frame holding a wanted piece is read whole, once,
and its checksum recomputed from the bytes actually read before any of its pieces is handed on.
Uncompressed frames are read straight into the destination buffers with one scatter read
(``preadv``) and hashed in place, so reading costs one pass over the bytes.

Everything above (cutting shards, :mod:`tiers.reshard`; decoding items, :mod:`tiers.reader`;
format conversion) reads through :func:`read_pieces` into a :class:`ByteBuffers`.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import xxhash

from tierstate.errors import TierstateError

from .codecs import CodecError, decompress
from .format import FrameRecord, Manifest, ObjectRecord, Piece, TensorRecord
from .safeopen import check_regular, open_read

IOV_MAX = 1024
K = TypeVar("K", bound=Hashable)


class CorruptCheckpointError(TierstateError, ValueError):
    """Bytes on disk do not match their checksum or cannot be decoded; names file and frame."""


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
    Pieces of one frame may be filled by different threads; each has bytes of its own.
    """

    def __init__(self) -> None:
        self.buffers: dict[Hashable, torch.Tensor] = {}
        self.bases: dict[Hashable, int] = {}

    def add(self, key: Hashable, nbytes: int, base: int = 0) -> None:
        self.buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
        self.bases[key] = base

    def view(self, key: Hashable, piece: Piece) -> memoryview:
        start = piece.item_offset - self.bases[key]
        return tensor_bytes(self.buffers[key])[start : start + piece.length]


def _read_exact(fd: int, offset: int, length: int, where: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise CorruptCheckpointError(f"{where}: truncated (read {len(data)} of {length} bytes)")
    return data


def _scatter_read(fd: int, offset: int, views: list[memoryview], where: str) -> None:
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


def _frame_views(ordered: list[tuple[Hashable, Piece]], length: int, dest: PieceDestination) -> list[memoryview] | None:
    """Destination views covering the whole frame in order (padding read into scratch), or None."""
    views, position = [], 0
    for key, piece in ordered:
        if piece.offset < position:
            return None
        if piece.offset > position:
            views.append(memoryview(bytearray(piece.offset - position)))
        views.append(dest.view(key, piece))
        position = piece.offset + piece.length
    if position > length:
        return None
    if position < length:
        views.append(memoryview(bytearray(length - position)))
    return views


def _check_frame(frame: FrameRecord, actual: str, where: str) -> None:
    if actual != frame.checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch (expected {frame.checksum}, got {actual})")


def _read_frame(
    fd: int, frame: FrameRecord, pieces: list[tuple[Hashable, Piece]], dest: PieceDestination, where: str
) -> None:
    ordered = sorted(pieces, key=lambda kp: kp[1].offset)
    views = _frame_views(ordered, frame.raw_length, dest) if frame.codec == "none" else None
    if views is not None:
        _scatter_read(fd, frame.offset, views, where)
        hasher = xxhash.xxh3_64()
        for view in views:
            hasher.update(view)
        _check_frame(frame, hasher.hexdigest(), where)
        return
    stored = _read_exact(fd, frame.offset, frame.length, where)
    _check_frame(frame, xxhash.xxh3_64_hexdigest(stored), where)
    try:
        raw = memoryview(decompress(stored, frame.codec, frame.raw_length, frame.shuffle)).cast("B")
    except CodecError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    for key, piece in ordered:
        dest.view(key, piece)[:] = raw[piece.offset : piece.offset + piece.length]


def check_file_sizes(directory: Path, manifest: Manifest) -> None:
    """Refuse data files shorter than the manifest says, before anything is allocated for them.

    Sizes in a manifest are claims; held against the files on disk they bound every buffer a read
    allocates by the bytes really there (times zstd's largest ratio for compressed frames), and a
    truncation is reported at once, by file and first missing frame.
    """
    for name, record in manifest.files.items():
        path = directory / name
        try:
            size = check_regular(path).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: data file missing") from None
        if size < record.size:
            cut = next((i for i, f in enumerate(record.frames) if f.offset + f.length > size), None)
            where = path if cut is None else f"{path} frame {cut}"
            raise CorruptCheckpointError(f"{where}: truncated ({size} bytes on disk, the manifest says {record.size})")


def read_pieces(
    directory: Path,
    manifest: Manifest,
    wanted: Mapping[Hashable, Sequence[Piece]],
    dest: PieceDestination,
    workers: int = 4,
) -> int:
    """Read and verify every frame that holds a wanted piece, scattering the pieces into ``dest``.

    Frames are the unit of verification, so a frame is read whole even when only some of its
    bytes are wanted; each frame is read once however many pieces it holds. Returns the stored
    bytes read.
    """
    by_frame: dict[tuple[str, int], list[tuple[Hashable, Piece]]] = defaultdict(list)
    for key, pieces in wanted.items():
        for piece in pieces:
            by_frame[(piece.file, piece.frame)].append((key, piece))
    fds: dict[str, int] = {}
    try:
        for name in {file for file, _ in by_frame}:
            try:
                fds[name] = open_read(directory / name)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{directory / name}: data file missing") from None
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tierstate-read") as pool:
            futures = [
                pool.submit(
                    _read_frame,
                    fds[file],
                    manifest.files[file].frames[frame],
                    pieces,
                    dest,
                    f"{directory / file} frame {frame}",
                )
                for (file, frame), pieces in sorted(by_frame.items())
            ]
            for future in futures:
                future.result()
    finally:
        for fd in fds.values():
            os.close(fd)
    return sum(manifest.files[file].frames[frame].length for file, frame in by_frame)


def read_records(
    directory: Path, manifest: Manifest, records: Mapping[K, TensorRecord | ObjectRecord], workers: int = 4
) -> dict[K, torch.Tensor]:
    """The stored bytes of each record, every frame verified on the way: key -> uint8 tensor of its own."""
    dest = ByteBuffers()
    for key, record in records.items():
        dest.add(key, manifest.record_nbytes(record))
    read_pieces(directory, manifest, {key: record.pieces for key, record in records.items()}, dest, workers)
    return {key: dest.buffers[key] for key in records}
