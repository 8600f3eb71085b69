"""Rewriting a checkpoint in the other container format (frames <-> HDF5), for ``migrate --format``.

A conversion is a rewrite, not a copy: the bytes of every stored record (a tensor, an object, a
shard, one rank's value) are read and verified through the reader, then written into the target
format's data file for the same rank, each piece a frame of at most :data:`FRAME_BYTES`; the new
manifest is the old one with new files and pieces. At most :data:`BATCH_BYTES` (or one record, if
larger) are in memory at a time. Unlike a same-format copy it is not resumable: an interrupted
conversion starts over.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import TypeVar, get_args

import torch

from ..reading.pieces import read_records
from ..storage.safeopen import write_durably
from .container import Chunk, ChunkEntry, ContainerWriter, Format
from .format import ManifestError, checksum, index_bytes, manifest_bytes, parse_manifest
from .framefile import FrameFile
from .hdf5 import Hdf5Container
from .manifest import Manifest
from .names import data_file_name, data_file_rank, hdf5_file_name, index_file_name, parse_rank_file
from .records import AliasRecord, AnyRecord, FileRecord, ObjectRecord, PerRankRecord, Piece, ShardedRecord, TensorRecord

FORMATS: tuple[str, ...] = get_args(Format)
FRAME_BYTES = 16 << 20  # the default chunk size: frames as large as the pipeline writes
BATCH_BYTES = 256 << 20

Progress = Callable[[int], None]
LeafId = tuple[str, int | None]  # (item key, shard index or rank), None for a plain record
Leaf = TensorRecord | ObjectRecord
K = TypeVar("K", bound=Hashable)


def container_format(manifest: Manifest, source: str) -> Format:
    """Which container the checkpoint's data files are; one checkpoint never mixes them."""
    kinds: set[Format] = {"hdf5" if _kind(name) == "h5" else "frames" for name in manifest.files}
    if len(kinds) > 1:
        raise ManifestError(f"{source}: data files mix the frames and HDF5 formats")
    return kinds.pop() if kinds else "frames"


def _kind(name: str) -> str | None:
    parsed = parse_rank_file(name)
    return parsed.kind if parsed is not None else None


def _rank_of(source_file: str) -> int:
    rank = data_file_rank(source_file)
    if rank is None:
        raise ManifestError(f"data file {source_file!r} does not name a rank")
    return rank


def _target_name(fmt: str, source_file: str) -> str:
    rank = _rank_of(source_file)
    return hdf5_file_name(rank) if fmt == "hdf5" else data_file_name(rank)


def leaves(key: str, record: AnyRecord) -> Iterator[tuple[LeafId, Leaf]]:
    """The records of ``key`` that own bytes: itself, each shard, or each rank's value."""
    if isinstance(record, ShardedRecord):
        for i, shard in enumerate(record.shards):
            yield (key, i), shard
    elif isinstance(record, PerRankRecord):
        for rank, part in record.ranks.items():
            if not isinstance(part, AliasRecord):
                yield (key, rank), part
    elif not isinstance(record, AliasRecord):
        yield (key, None), record


def _with_pieces(key: str, record: AnyRecord, pieces: dict[LeafId, list[Piece]]) -> AnyRecord:
    """``record`` with every leaf's pieces replaced by the rewritten ones."""
    if isinstance(record, ShardedRecord):
        shards = [shard.model_copy(update={"pieces": pieces[(key, i)]}) for i, shard in enumerate(record.shards)]
        return record.model_copy(update={"shards": shards})
    if isinstance(record, PerRankRecord):
        ranks = {
            rank: part if isinstance(part, AliasRecord) else part.model_copy(update={"pieces": pieces[(key, rank)]})
            for rank, part in record.ranks.items()
        }
        return record.model_copy(update={"ranks": ranks})
    if isinstance(record, AliasRecord):
        return record
    return record.model_copy(update={"pieces": pieces[(key, None)]})


def batches(items: list[tuple[K, Leaf]], manifest: Manifest) -> Iterator[dict[K, Leaf]]:
    """Consecutive groups of leaves holding at most BATCH_BYTES (a larger leaf alone)."""
    batch: dict[K, Leaf] = {}
    size = 0
    for lid, leaf in items:
        nbytes = manifest.record_nbytes(leaf)
        if batch and size + nbytes > BATCH_BYTES:
            yield batch
            batch, size = {}, 0
        batch[lid] = leaf
        size += nbytes
    if batch:
        yield batch


def write_sliced(writer: ContainerWriter, key: str, data: torch.Tensor, progress: Progress | None) -> list[Piece]:
    """Write one item's bytes as frames of at most FRAME_BYTES; their pieces, in item order."""
    view = data.numpy().data.cast("B") if data.numel() else memoryview(b"")
    pieces = []
    for start in range(0, len(view), FRAME_BYTES):
        part = view[start : start + FRAME_BYTES]
        for _, piece in writer.write(Chunk(entries=[ChunkEntry(key, start, len(part), 0)], raw=part)):
            pieces.append(Piece(**piece))
        if progress is not None:
            progress(len(part))
    return pieces


def declare(container: Hdf5Container, key: str, leaf: Leaf) -> None:
    """Create ``key``'s dataset for a stored record."""
    if isinstance(leaf, TensorRecord):
        container.add_tensor(key, leaf.dtype, leaf.shape, leaf.shard)
    else:
        container.add_object(key, leaf.serializer, leaf.length)


def rewrite(
    source: Path, manifest: Manifest, target: Path, fmt: Format, align: int, progress: Progress | None = None
) -> Manifest:
    """Write the checkpoint in ``source`` into directory ``target`` as ``fmt``; the new manifest.

    Writes the data files and indexes, not the manifest: the caller verifies and commits.
    """
    first_file = min(manifest.files, default=data_file_name(0))
    by_file: dict[str, list[tuple[LeafId, Leaf]]] = {}
    for key, record in manifest.items.items():
        for lid, leaf in leaves(key, record):
            origin = leaf.pieces[0].file if leaf.pieces else first_file  # empty tensors: any file
            by_file.setdefault(_target_name(fmt, origin), []).append((lid, leaf))
    files: dict[str, FileRecord] = {}
    indexes: dict[str, str] = {}
    pieces: dict[LeafId, list[Piece]] = {}
    for name, file_leaves in sorted(by_file.items()):
        files[name] = _write_file(source, manifest, target / name, fmt, align, file_leaves, pieces, progress)
    items = {key: _with_pieces(key, record, pieces) for key, record in manifest.items.items()}
    rewritten_leaves = dict(leaf for key, record in items.items() for leaf in leaves(key, record))
    for name, file_leaves in sorted(by_file.items()):
        # Each index holds its rank's own records, rewritten: the leaves in its file, and the aliases of those.
        own = {lid[0]: rewritten_leaves[lid] for lid, _ in file_leaves}
        own |= {key: r for key, r in items.items() if isinstance(r, AliasRecord) and r.of in own}
        rank = _rank_of(name)
        index = index_bytes(rank, manifest.step, files[name], {k: r.model_dump(mode="json") for k, r in own.items()})
        write_durably(target / index_file_name(rank), index)
        indexes[index_file_name(rank)] = checksum(index)
    rewritten = manifest.model_copy(update={"files": files, "indexes": indexes, "items": items})
    return parse_manifest(manifest_bytes(rewritten), f"{target} (rewritten manifest)")  # fully re-validated


def _write_file(
    source: Path,
    manifest: Manifest,
    path: Path,
    fmt: Format,
    align: int,
    file_leaves: list[tuple[LeafId, Leaf]],
    pieces: dict[LeafId, list[Piece]],
    progress: Progress | None,
) -> FileRecord:
    writer: ContainerWriter
    container: Hdf5Container | None = None
    if fmt == "hdf5":
        container = Hdf5Container(path, align, {"step": manifest.step, "created": manifest.created})
        writer = container
    else:
        writer = FrameFile(path, align, io="buffered")  # read back into torch buffers, not host-cache slabs
    try:
        if container is not None:
            for (key, _), leaf in file_leaves:
                declare(container, key, leaf)
            plain = {key for (key, index), _ in file_leaves if index is None}
            for key, record in manifest.items.items():
                if isinstance(record, AliasRecord) and record.of in plain:  # tied tensors: hard links
                    container.add_alias(key, record.of)
        for batch in batches(file_leaves, manifest):
            for lid, data in read_records(source, manifest, batch).items():
                pieces[lid] = write_sliced(writer, lid[0], data, progress)
        return writer.finish()
    except BaseException:
        writer.close()
        raise
