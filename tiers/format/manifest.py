"""The manifest: the one record of a checkpoint a reader trusts, written last to commit it.

It names every data file with its frames, every item with its pieces, and, for a node's part of a
multi-rank checkpoint, which node and ranks it covers. tiers/format/format.py writes it with a
self-checksum, and parses and checks it before a byte of data is read.
"""

from __future__ import annotations

import math
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from .dtypes import dtype_from_name
from .rankstats import RankStatsRecord
from .records import AliasRecord, AnyRecord, FileRecord, ItemRecord, ObjectRecord, PerRankRecord, ShardedRecord
from .strict import NonNegative, Strict

FORMAT_NAME = "tierstate"
FORMAT_VERSION = 3  # the newest this reads
MULTI_RANK_VERSION = 2  # 2 adds the multi-rank kinds "sharded" and "per_rank"
NODE_PART_VERSION = 3  # 3 adds ``node_part``: a node's part of a checkpoint, on a node-scoped tier
MANIFEST_NAME = "manifest.json"

#: A checkpoint's id: 32 lowercase hex digits (a random UUID), drawn once when the checkpoint is made. (pydantic's
#: regex engine is Rust's, whose ``$`` is the end of the text: no trailing newline slips through.)
CheckpointId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


def new_checkpoint_id() -> str:
    """A fresh checkpoint id: random, so two checkpoints of one step made in the same millisecond (two runs
    sharing a bucket prefix) are told apart, where their ``created`` times are not."""
    return uuid.uuid4().hex


class NodePart(Strict):
    """Marks a manifest as one node's part of a multi-rank checkpoint (on a node-scoped tier).

    Its ``items`` are the whole checkpoint's, but ``files`` and ``indexes`` list only those of
    ``ranks`` (this node's), so pieces may lie in files of other nodes' ranks, which are not here.
    ``nodes``: every node holding a part, so a flush knows when all of them reached a shared tier.
    """

    node: Annotated[str, Field(min_length=1)]
    ranks: list[Annotated[int, Field(ge=0)]]
    nodes: list[Annotated[str, Field(min_length=1)]]


class Manifest(Strict):
    format: Literal["tierstate"] = FORMAT_NAME
    version: int = 1  # the oldest format that can express it: single-rank manifests stay readable by v1
    step: NonNegative
    created: str
    world_size: Annotated[int, Field(ge=1, le=1 << 20)] = 1
    files: dict[str, FileRecord]
    indexes: dict[str, str] = {}
    items: dict[str, ItemRecord]
    node_part: NodePart | None = None
    # Which checkpoint this is, whatever copy, part or format it is read from: every rank and node of one
    # checkpoint carries the same id, migration and conversion keep it. Optional: manifests written before
    # it stay valid (and two of them are then told apart by step, creation time and items only).
    checkpoint_id: CheckpointId | None = None
    # What writing each rank's part cost (informative, never used to read). Optional: manifests
    # written before it, and by tools that measure nothing, stay valid.
    stats: dict[Annotated[int, Field(ge=0)], RankStatsRecord] | None = None

    @model_serializer(mode="wrap")
    def _unset_optionals_left_out(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``node_part``, ``checkpoint_id`` and ``stats`` are left out unless set, so a whole checkpoint's
        JSON (an older one, migrated or converted) is written as it was, not with nulls older readers would
        refuse."""
        body: dict[str, Any] = dump(self)
        for optional in ("node_part", "checkpoint_id", "stats"):
            if getattr(self, optional) is None:
                body.pop(optional, None)
        return body

    def same_checkpoint(self, other: Manifest) -> bool:
        """Whether ``other`` describes the same checkpoint (another copy, part or format of it): by the
        checkpoint id when both carry one (two checkpoints of one step created in the same millisecond are
        not the same), else, for manifests written before the id, by step, creation time and item keys."""
        if self.checkpoint_id is not None and other.checkpoint_id is not None:
            return self.step == other.step and self.checkpoint_id == other.checkpoint_id
        return self.step == other.step and self.created == other.created and self.items.keys() == other.items.keys()

    def item_nbytes(self, key: str) -> int:
        return self.record_nbytes(self.items[key])

    def record_nbytes(self, record: AnyRecord) -> int:
        """Bytes the record's pieces hold; for the multi-rank kinds, the sum over their parts."""
        if isinstance(record, AliasRecord):
            return self.item_nbytes(record.of)
        if isinstance(record, ObjectRecord):
            return record.length
        if isinstance(record, ShardedRecord):
            return sum(self.record_nbytes(shard) for shard in record.shards)
        if isinstance(record, PerRankRecord):
            return sum(self.record_nbytes(part) for part in record.ranks.values())
        return math.prod(record.shape) * dtype_from_name(record.dtype).itemsize

    @property
    def stored_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def raw_bytes(self) -> int:
        return sum(fr.raw_length for f in self.files.values() for fr in f.frames)
