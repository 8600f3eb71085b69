"""Reading a committed checkpoint back into plain tensors and objects, verifying as it reads.

Every frame's checksum is recomputed from the bytes actually read before anything decoded from it
is returned. Uncompressed frames are read straight into the destination tensors with one
scatter read (``preadv``) and hashed in place, so restore costs one pass over the bytes.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash

from tierstate.errors import TierstateError

from .codecs import CodecError, decompress
from .dtypes import dtype_from_name
from .format import (
    AliasRecord,
    FrameRecord,
    Manifest,
    ObjectRecord,
    PerRankRecord,
    Piece,
    ShardedRecord,
    TensorRecord,
    read_manifest,
)
from .objcodec import decode_object

IOV_MAX = 1024


class CorruptCheckpointError(TierstateError, ValueError):
    """Bytes on disk do not match their checksum or cannot be decoded; names file and frame."""


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")


class PieceDestination(Protocol):
    """Where read pieces land: a writable view of exactly ``piece.length`` bytes per (key, piece)."""

    def view(self, key: Hashable, piece: Piece) -> memoryview: ...


class _Destination:
    """Preallocated buffers, one per item read, filled piece by piece (possibly by many threads)."""

    def __init__(self, manifest: Manifest, keys: Iterable[str]) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        for key in keys:
            self.buffers[key] = torch.empty(manifest.item_nbytes(key), dtype=torch.uint8)

    def view(self, key: str, piece: Piece) -> memoryview:
        return _tensor_bytes(self.buffers[key])[piece.item_offset : piece.item_offset + piece.length]


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


def _frame_views(
    ordered: list[tuple[Hashable, Piece]], length: int, dest: PieceDestination
) -> list[memoryview] | None:
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
        actual = hasher.hexdigest()
    else:
        stored = _read_exact(fd, frame.offset, frame.length, where)
        actual = xxhash.xxh3_64_hexdigest(stored)
    if actual != frame.checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch (expected {frame.checksum}, got {actual})")
    if views is not None:
        return
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
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: data file missing") from None
        if size < record.size:
            cut = next((i for i, f in enumerate(record.frames) if f.offset + f.length > size), None)
            where = path if cut is None else f"{path} frame {cut}"
            raise CorruptCheckpointError(f"{where}: truncated ({size} bytes on disk, the manifest says {record.size})")


def _stored_keys(manifest: Manifest, keys: Iterable[str]) -> set[str]:
    stored = set()
    for key in keys:
        record = manifest.items[key]
        stored.add(record.of if isinstance(record, AliasRecord) else key)
    return stored


def read_items(
    directory: Path,
    manifest: Manifest | None = None,
    keys: Iterable[str] | None = None,
    allow_pickle: bool = False,
    workers: int = 4,
) -> dict[str, Any]:
    """Read items (all by default) of the checkpoint in ``directory``: key -> tensor (CPU) or object.

    Of a multi-rank checkpoint, sharded tensors come back whole and per-rank items as rank 0's.
    """
    manifest = manifest or read_manifest(directory)
    wanted = list(manifest.items) if keys is None else list(keys)
    unknown = [k for k in wanted if k not in manifest.items]
    if unknown:
        raise KeyError(f"{directory}: no item(s) {', '.join(unknown[:8])}")
    check_file_sizes(directory, manifest)
    if any(isinstance(manifest.items[_target(manifest, k)], ShardedRecord | PerRankRecord) for k in wanted):
        # Reassembly builds on this module (read_pieces), hence the import here and not at the top.
        from .reshard import read_global

        return read_global(directory, manifest, wanted, rank=0, allow_pickle=allow_pickle, workers=workers)
    stored = _stored_keys(manifest, wanted)
    dest = _Destination(manifest, stored)
    read_pieces(directory, manifest, {key: manifest.items[key].pieces for key in stored}, dest, workers)
    values = {key: _decode(manifest.items[key], dest.buffers[key], key, allow_pickle) for key in stored}
    return {key: values[_target(manifest, key)] for key in wanted}


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
                fds[name] = os.open(directory / name, os.O_RDONLY)
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


def _target(manifest: Manifest, key: str) -> str:
    record = manifest.items[key]
    return record.of if isinstance(record, AliasRecord) else key


def _decode(record: TensorRecord | ObjectRecord, buffer: torch.Tensor, key: str, allow_pickle: bool) -> Any:
    if isinstance(record, ObjectRecord):
        return decode_object(bytes(buffer.numpy()), record.serializer, allow_pickle)
    return buffer.view(dtype_from_name(record.dtype)).reshape(record.shape)


def load(path: str | os.PathLike[str], allow_pickle: bool = False) -> dict[str, Any]:
    """The plain state of one committed checkpoint directory, without a runner: key -> value."""
    return read_items(Path(path), allow_pickle=allow_pickle)
