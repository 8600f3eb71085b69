"""The manifest: the one record of a checkpoint a reader trusts, written last to commit it.

It names every data file with its frames, every item with its pieces, and, for a node's part of a
multi-rank checkpoint, which node and ranks it covers. tiers/format.py writes it with a
self-checksum, and parses and checks it before a byte of data is read.
"""

from __future__ import annotations

import math
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
    # What writing each rank's part cost (informative, never used to read). Optional: manifests
    # written before it, and by tools that measure nothing, stay valid.
    stats: dict[Annotated[int, Field(ge=0)], RankStatsRecord] | None = None

    @model_serializer(mode="wrap")
    def _unset_optionals_left_out(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``node_part`` and ``stats`` are left out unless set, so a whole checkpoint's JSON (an older
        one, migrated or converted) is written as it was, not with nulls older readers would refuse."""
        body: dict[str, Any] = dump(self)
        if self.node_part is None:
            body.pop("node_part", None)
        if self.stats is None:
            body.pop("stats", None)
        return body

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
