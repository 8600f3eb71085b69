"""The persist stage's HDF5 target (``format: hdf5``): chunk bytes go straight into their datasets.

A chunk coalesces several items, but in HDF5 each item is its own dataset, so every entry of a
chunk becomes its own frame at its dataset's address (see :mod:`tiers.hdf5`). Datasets of the
plan's tensors are declared before the first chunk arrives; an object's dataset when its encoded
bytes (and so its length) exist. Frames are written raw, so the compress stage must be off
(``codec: none``, checked when the YAML is loaded).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

from ..tiers.dtypes import dtype_name
from ..tiers.format import FileRecord, Piece, ShardRecord, piece_body
from ..tiers.hdf5 import Hdf5Container, hdf5_file_name
from ..tiers.pacing import Pacer
from .persist import FrameWriter
from .plan import CheckpointPlan
from .units import Chunk, run_blocking


class Hdf5Writer:
    """One rank's HDF5 data file, written by any number of persist workers at once.

    Construction declares every tensor dataset through h5py, which blocks: build it in an executor.
    """

    def __init__(
        self,
        directory: Path,
        rank: int,
        plan: CheckpointPlan,
        step: int,
        align: int,
        bandwidth: int | None,
        pool: concurrent.futures.Executor,
    ) -> None:
        self.path = directory / hdf5_file_name(rank)
        self.name = self.path.name
        self._container = Hdf5Container(self.path, align, {"step": step, "rank": rank})
        try:
            for item in plan.tensors:
                shard = None
                if item.shard is not None:
                    shard = ShardRecord(global_shape=list(item.shard.global_shape), offsets=list(item.shard.offsets))
                self._container.add_tensor(item.key, dtype_name(item.tensor.dtype), list(item.tensor.shape), shard)
        except BaseException:
            self._container.close()
            raise
        self._serializers = {item.key: item.serializer for item in plan.objects}
        self._aliases = dict(plan.aliases)
        self._pacer = Pacer(bandwidth)
        self._pool = pool

    async def write(self, chunk: Chunk) -> list[tuple[str, Piece]]:
        """Write each entry of ``chunk`` into its dataset; where each piece now lies."""
        pieces = await run_blocking(self._pool, self._write_entries, chunk)
        delay = self._pacer.delay(len(chunk.raw))
        if delay:
            await asyncio.sleep(delay)
        return pieces

    def _write_entries(self, chunk: Chunk) -> list[tuple[str, Piece]]:
        if chunk.stored is not None:
            raise ValueError(f"{self.path}: HDF5 datasets hold raw bytes, but a chunk arrived compressed")
        pieces = []
        for entry in chunk.entries:
            if entry.key in self._serializers:
                self._container.add_object(entry.key, self._serializers[entry.key], entry.length)
            if entry.length:
                data = chunk.raw[entry.chunk_offset : entry.chunk_offset + entry.length]
                pieces.append((entry.key, self._container.write(entry.key, entry.item_offset, data)))
        return pieces

    def finish(self) -> FileRecord:
        """Link tied tensors, close and fsync the file. Blocking: run it in an executor."""
        for key, target in self._aliases.items():
            self._container.add_alias(key, target)
        return self._container.finish()

    def close(self) -> None:
        self._container.close()


async def write_chunk(writer: FrameWriter | Hdf5Writer, chunk: Chunk) -> list[tuple[str, dict[str, Any]]]:
    """Persist one chunk with either writer: where each of its entries' bytes now lie (JSON-form Pieces).

    The frames writer stores the whole chunk as one frame, so its entries are pieces of that frame.
    """
    if isinstance(writer, Hdf5Writer):
        return [(key, piece.model_dump()) for key, piece in await writer.write(chunk)]
    frame = await writer.write(chunk)
    return [(e.key, piece_body(writer.name, frame, e.chunk_offset, e.length, e.item_offset)) for e in chunk.entries]
