"""The records of what a checkpoint stores: frames in data files, items in frames, one rank's index.

An item is a tensor, an object, an alias of another item (tied weights), a tensor sharded over
ranks, or a value per rank; its pieces say which bytes of which frame hold it. The manifest
(tiers/format/manifest.py) gathers them; tiers/format/format.py reads and writes them and checks them against
each other.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from ..reading.boxes import Box, tiling_problem
from .codecs import Codec, ShuffleWidth
from .strict import NonNegative, Strict


class FrameRecord(Strict):
    """One chunk as stored: where it is in its data file, how it is encoded, its checksum."""

    offset: NonNegative
    length: NonNegative
    raw_length: NonNegative
    codec: Codec
    shuffle: ShuffleWidth = 1
    checksum: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]


class FileRecord(Strict):
    size: NonNegative
    frames: list[FrameRecord]


class Piece(Strict):
    """A byte range of one item inside one frame's decoded bytes."""

    file: str
    frame: NonNegative
    offset: NonNegative
    length: NonNegative
    item_offset: NonNegative


class ShardRecord(Strict):
    global_shape: list[NonNegative]
    offsets: list[NonNegative]


class TensorRecord(Strict):
    kind: Literal["tensor"] = "tensor"
    dtype: str
    shape: list[NonNegative]
    shard: ShardRecord | None = None
    pieces: list[Piece]


class ObjectRecord(Strict):
    kind: Literal["object"] = "object"
    serializer: Literal["json", "msgpack", "pickle"]
    length: NonNegative
    pieces: list[Piece]


class AliasRecord(Strict):
    """An item that is the very same tensor as another (tied weights): stored once."""

    kind: Literal["alias"] = "alias"
    of: str


class ShardedRecord(Strict):
    """A global tensor written as shards by several ranks; together the shards tile it exactly once.

    Each shard is a TensorRecord whose ``shard`` places it in the global tensor, so a reader with
    any world size can reassemble the whole or cut out the box it needs.
    """

    kind: Literal["sharded"] = "sharded"
    dtype: str
    global_shape: list[NonNegative]
    shards: list[TensorRecord]

    @model_validator(mode="after")
    def _tiles_global_tensor(self) -> ShardedRecord:
        for shard in self.shards:
            if shard.shard is None or shard.shard.global_shape != self.global_shape or shard.dtype != self.dtype:
                raise ValueError(f"every shard must be {self.dtype} placed in global shape {self.global_shape}")
        problem = tiling_problem(self.boxes(), self.global_shape)
        if problem:
            raise ValueError(problem)
        return self

    def boxes(self) -> list[Box]:
        return [Box(tuple(s.shard.offsets), tuple(s.shape)) for s in self.shards if s.shard is not None]


RankRecord = Annotated[TensorRecord | ObjectRecord | AliasRecord, Field(discriminator="kind")]


class PerRankRecord(Strict):
    """An item each rank holds its own value of (RNG state, per-rank counters): one record per rank."""

    kind: Literal["per_rank"] = "per_rank"
    ranks: dict[Annotated[int, Field(ge=0)], RankRecord]


AnyRecord = TensorRecord | ObjectRecord | AliasRecord | ShardedRecord | PerRankRecord
ItemRecord = Annotated[AnyRecord, Field(discriminator="kind")]


def stored_key(key: str, record: AnyRecord) -> str:
    """The key whose record holds the bytes of item ``key`` (``record``): an alias's target, else ``key``.

    Tied tensors are stored once; every reader that meets an alias reads its target instead.
    """
    return record.of if isinstance(record, AliasRecord) else key


class IndexRecord(Strict):
    """One rank's index file: its data file's frames and the items that rank wrote."""

    rank: Annotated[int, Field(ge=0, lt=1 << 20)]
    step: NonNegative
    file: FileRecord
    items: dict[str, RankRecord]
