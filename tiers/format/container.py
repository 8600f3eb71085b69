"""The seam between moving bytes and storing them: one writer protocol, two container formats.

Whoever produces a checkpoint's bytes (the persist stage, ``migrate --format``, ``export``) hands a
:class:`ContainerWriter` chunks of bytes with the item ranges they hold, and gets back where each
range now lies; it never learns how the container lays them out. Two formats implement it: the
frames data file (:class:`tiers.format.framefile.FrameFile`, one checksummed frame per chunk) and the HDF5
file (:class:`tiers.format.hdf5.Hdf5Container`, each item range a frame inside its dataset). Like PyTorch
DCP's ``StorageWriter`` or Orbax's handlers, the caller decides what to write and when; the writer
only how. Retrying and naming failures are the caller's, so the writer's calls are made safe to
repeat: writing the same chunk again after a failure puts the same bytes in the same place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from ..storage.hostcache import Slab
from .codecs import Codec, ShuffleWidth
from .records import FileRecord

Format = Literal["frames", "hdf5"]

#: Where a range of an item's bytes now lies: (item key, a :class:`~tiers.format.records.Piece` in JSON form,
#: see :func:`~tiers.format.format.piece_body`). JSON form because a checkpoint may hold 10^4 tensors.
ItemPiece = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class ChunkEntry:
    """Bytes [item_offset, item_offset + length) of item ``key`` sit at ``chunk_offset``."""

    key: str
    item_offset: int
    length: int
    chunk_offset: int


@dataclass
class Chunk:
    """A contiguous run of bytes holding whole items or ranges of them, and the entries saying which."""

    entries: list[ChunkEntry]
    raw: memoryview
    slab: Slab | None = None  # the host-cache slab ``raw`` lies in (aligned: a frame may go O_DIRECT from it)
    codec: Codec = "none"
    shuffle: ShuffleWidth = 1
    element_size: int = 1  # the byte-shuffle width that suits this chunk's dtypes
    stored: memoryview | bytes | None = None  # the compressed form of ``raw``, if compression shrank it
    # The checksum of ``raw`` (tiers.format.format.checksum), taken by whoever filled it (capture, for host
    # bytes): the writer stores it as is, so bytes changed in between fail verification instead of
    # being hashed anew. None: the writer hashes the bytes it writes.
    raw_checksum: str | None = None

    @property
    def payload_checksum(self) -> str | None:
        """The checksum of :attr:`payload` if already known (raw bytes hashed when filled), else None."""
        return self.raw_checksum if self.stored is None else None

    @property
    def payload(self) -> memoryview | bytes:
        """The bytes a container stores: compressed when compression shrank them, else the raw bytes."""
        return self.raw if self.stored is None else self.stored


@dataclass(frozen=True)
class TensorLayout:
    """A tensor as a container may need to know it before its bytes arrive (HDF5 declares its dataset)."""

    dtype: str
    shape: list[int]
    shard: tuple[list[int], list[int]] | None = None  # (global shape, offsets) of a shard


@dataclass
class Layout:
    """Which items one rank's data file holds, as far as known before any of their bytes.

    An object's length is known only once it is encoded, so its bytes must arrive whole, in one entry.
    """

    tensors: dict[str, TensorLayout] = field(default_factory=dict)
    objects: dict[str, str] = field(default_factory=dict)  # key -> serializer
    aliases: dict[str, str] = field(default_factory=dict)  # key -> key of the identical stored tensor


class ContainerWriter(Protocol):
    """One data file being written, by any number of threads at once. Every method blocks.

    ``write`` may be repeated with the same chunk after it raised: the bytes go to the same place
    again, so a retry neither leaves a frame twice nor mixes old and new bytes. ``finish`` must not
    be repeated (after a failed fsync the kernel may report a later one clean although data was lost).
    """

    path: Path
    name: str

    def write(self, chunk: Chunk) -> list[ItemPiece]:
        """Store ``chunk``; where each of its entries' bytes now lie."""
        ...

    def finish(self) -> FileRecord:
        """Make the file durable (fsync) and close it; its record for the manifest."""
        ...

    def close(self) -> None:
        """Abandon the file after a failure; never raises for an already closed one."""
        ...
