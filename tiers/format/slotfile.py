"""The frames container over a memory tier's slot: the tensor frames are in the file before it is "written".

A slot (tiers/storage/slots.py) is the rank's data file, mapped; capture copied each chunk of tensor
bytes straight into the mapping at the offset its frame has (the planned layout: chunk after chunk,
each at the next ``align`` boundary). So writing such a chunk only records its frame: the checksum
capture took while the bytes were hot (a GPU's chunk, which capture does not hash, is hashed here,
from the mapping, off the path the optimizer waits for). Anything else (the encoded objects, whose
length is known only once encoded) is written after the tensor frames by the ordinary frame writer,
with ``pwrite``: a few bytes, never through the mapping, so a full file system fails that write with
ENOSPC, never a mapped page with SIGBUS. The file's size, index and manifest are those of any frames
file: restore, verify, flush and the CLI read it as they read every data file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .container import Chunk, ItemPiece
from .format import checksum, piece_body
from .framefile import FrameFile
from .records import FileRecord


@dataclass(frozen=True)
class SlotRegion:
    """Where a slot's tensor frames lie: ``frames`` (offset, length) in the file, in the plan's chunk order, and
    the mapping that holds them (``base``: its address, ``size``: its length)."""

    frames: list[tuple[int, int]]
    base: int
    size: int


class SlotFile:
    """The data file at ``path`` (the slot, renamed there), its tensor frames in ``region``."""

    def __init__(self, path: Path, align: int, region: SlotRegion) -> None:
        self.path = path
        self.name = path.name
        self._region = region
        # The objects' frames (written) start past the tensor region, which the slot's mapping covers.
        start = -(-region.size // align) * align
        self._file = FrameFile(path, align, "buffered", create=False, start=start)
        self._planned = {offset: length for offset, length in region.frames}
        for offset, length in region.frames:
            self._file.reserve(offset, length)  # indexes in the plan's order, whatever order chunks arrive in

    def write(self, chunk: Chunk) -> list[ItemPiece]:
        """A chunk capture put into the slot: its frame recorded; any other chunk: written after the tensor frames."""
        offset = self._offset(chunk)
        if offset is None:
            return self._file.write(chunk)
        length = len(chunk.raw)
        if self._planned.get(offset) != length or chunk.stored is not None:
            raise ValueError(f"{self.path}: a chunk of {length} bytes at {offset} is not one the slot's plan holds")
        index = self._file.record(offset, length, chunk.raw_checksum or checksum(chunk.raw))
        return [(e.key, piece_body(self.name, index, e.chunk_offset, e.length, e.item_offset)) for e in chunk.entries]

    def _offset(self, chunk: Chunk) -> int | None:
        """Where ``chunk``'s bytes lie in the slot, or None if they are not in its mapping."""
        if chunk.slab is None:
            return None
        offset = chunk.slab.tensor.data_ptr() - self._region.base
        return offset if 0 <= offset < self._region.size else None

    def finish(self) -> FileRecord:
        """Size the file to its last frame and fsync it (through the mapping's file: the same pages); its record."""
        return self._file.finish()

    def close(self) -> None:
        self._file.close()
