"""Reading boxes of tensors from a checkpoint: reassembling shards, or cutting a shard out of a whole.

A rank that wants box B of a tensor reads, of every stored shard overlapping B, only the pieces
(and so only the frames) that hold bytes of the overlap, then copies the overlaps into place. So
loading 2 ranks' shards on 1 reads both whole, loading 1 rank's tensor on 2 reads about half per
rank (the covering byte range of a box is contiguous when the split is along dimension 0), and
loading with the world size it was saved with reads each shard once, straight into its buffer.

Copies run on bytes (the last dimension widened by the element size), so every dtype reshards,
including those without element-wise copy kernels on CPU (float8, bits, sub-byte).

The middle reading layer: built on :mod:`tiers.reading.pieces` (frames -> verified bytes); loading whole
items (:mod:`tiers.reading.reader`) and restore on many ranks build on it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest
from ..format.records import Piece, ShardedRecord, TensorRecord
from .boxes import Box
from .pieces import ByteBuffers, allocate, read_pieces
from .source import ByteSource


@dataclass(frozen=True)
class Region:
    """Box ``box`` of the global tensor that ``record`` (one tensor, or its shards) describes."""

    key: str
    record: TensorRecord | ShardedRecord
    box: Box


def global_shape(record: TensorRecord | ShardedRecord) -> tuple[int, ...]:
    if isinstance(record, ShardedRecord):
        return tuple(record.global_shape)
    return tuple(record.shard.global_shape if record.shard is not None else record.shape)


def _sources(record: TensorRecord | ShardedRecord) -> list[tuple[Box, TensorRecord]]:
    """Every stored tensor of ``record`` with the box it fills; a plain tensor fills its whole shape."""
    if isinstance(record, ShardedRecord):
        return list(zip(record.boxes(), record.shards, strict=True))
    offsets = tuple(record.shard.offsets) if record.shard is not None else (0,) * len(record.shape)
    return [(Box(offsets, tuple(record.shape)), record)]


def source_files(region: Region) -> set[str]:
    """The data files holding bytes of ``region``: those of the stored tensors it overlaps."""
    return {
        piece.file
        for box, record in _sources(region.record)
        if box.intersect(region.box) is not None
        for piece in record.pieces
    }


def _byte_box(box: Box, itemsize: int) -> Box:
    """The same region of the tensor viewed as uint8, its last dimension ``itemsize`` times wider."""
    if not box.shape:
        return Box((0,), (itemsize,))
    return Box((*box.offsets[:-1], box.offsets[-1] * itemsize), (*box.shape[:-1], box.shape[-1] * itemsize))


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _flat(position: Sequence[int], shape: Sequence[int]) -> int:
    return sum(p * s for p, s in zip(position, _strides(shape), strict=True))


def _covering_pieces(record: TensorRecord, source: Box, overlap: Box, itemsize: int) -> list[Piece]:
    """The pieces of ``record`` holding any byte between the overlap's first and last element."""
    byte_source, byte_overlap = _byte_box(source, itemsize), _byte_box(overlap.relative_to(source), itemsize)
    first = _flat(byte_overlap.offsets, byte_source.shape)
    last = _flat([o + s - 1 for o, s in zip(byte_overlap.offsets, byte_overlap.shape, strict=True)], byte_source.shape)
    ordered = sorted(record.pieces, key=lambda p: p.item_offset)
    return [p for p in ordered if p.item_offset <= last and p.item_offset + p.length > first]


def _span(pieces: list[Piece]) -> tuple[int, int]:
    """The item bytes ``[first, end)`` that ``pieces`` (in item order, without gaps) hold together."""
    if not pieces:
        return 0, 0
    return pieces[0].item_offset, pieces[-1].item_offset + pieces[-1].length


class RegionsRead(NamedTuple):
    tensors: list[torch.Tensor]  # one per region, in order
    bytes_read: int  # stored bytes read for them (whole frames)


def read_regions(
    location: Path | ByteSource, manifest: Manifest, regions: Sequence[Region], workers: int = 4
) -> RegionsRead:
    """One tensor per region, its box of the global tensor, in one verified pass over the frames needed."""
    windows = ByteBuffers()
    wanted: dict[Hashable, list[Piece]] = {}
    overlaps: list[list[tuple[Hashable, Box, Box]]] = []
    for i, region in enumerate(regions):
        shape = global_shape(region.record)
        if not region.box.within(shape):
            raise ValueError(
                f"item {region.key!r}: box at {list(region.box.offsets)} of shape {list(region.box.shape)} "
                f"lies outside its global shape {list(shape)}"
            )
        itemsize = dtype_from_name(region.record.dtype).itemsize
        found = []
        for j, (source, record) in enumerate(_sources(region.record)):
            overlap = source.intersect(region.box)
            if overlap is not None:
                wanted[(i, j)] = _covering_pieces(record, source, overlap, itemsize)
                base, end = _span(wanted[(i, j)])
                windows.add((i, j), end - base, base, f"item {region.key!r}")
                found.append(((i, j), source, overlap))
        overlaps.append(found)
    bytes_read = read_pieces(location, manifest, wanted, windows, workers)
    tensors = [_assemble(region, found, windows) for region, found in zip(regions, overlaps, strict=True)]
    return RegionsRead(tensors, bytes_read)


def _assemble(region: Region, found: list[tuple[Hashable, Box, Box]], windows: ByteBuffers) -> torch.Tensor:
    dtype = dtype_from_name(region.record.dtype)
    if len(found) == 1 and found[0][1] == region.box:
        # The box is exactly one stored tensor: its buffer already is the result, no copy.
        return windows.tensor(found[0][0]).view(dtype).reshape(region.box.shape)
    out = allocate(region.box.shape, dtype, f"item {region.key!r}")
    out_bytes = out.reshape(-1).view(torch.uint8).reshape(_byte_box(region.box, dtype.itemsize).shape)
    for key, source, overlap in found:
        byte_source = _byte_box(source, dtype.itemsize)
        in_source = _byte_box(overlap.relative_to(source), dtype.itemsize)
        in_out = _byte_box(overlap.relative_to(region.box), dtype.itemsize)
        piece = torch.as_strided(
            windows.tensor(key),
            in_source.shape,
            _strides(byte_source.shape),
            _flat(in_source.offsets, byte_source.shape) - windows.bases[key],
        )
        target = out_bytes[tuple(slice(o, o + s) for o, s in zip(in_out.offsets, in_out.shape, strict=True))]
        target.copy_(piece)
    return out
