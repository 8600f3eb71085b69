"""The serialize stage: a checkpoint's Python objects encoded into one chunk of bytes.

Tensor chunks go past it: their bytes, as captured, are already their serialized form.
"""

from __future__ import annotations

from ...tiers.format.objcodec import ObjectCodecError, encode_object
from ..units import Chunk, ChunkEntry, ObjectBatch, Unit


class Serialize:
    """Each object by its item's serializer (json, msgpack, pickle where ``allow_pickle``), end to end."""

    def __init__(self, allow_pickle: bool) -> None:
        self._allow_pickle = allow_pickle

    def passes(self, unit: Unit) -> bool:
        return isinstance(unit, Chunk)

    def run(self, unit: Unit) -> Unit:
        if not isinstance(unit, ObjectBatch):
            return unit
        parts, entries, offset = [], [], 0
        for item in unit.objects:
            try:
                data = encode_object(item.value, item.serializer, self._allow_pickle)
            except ObjectCodecError as exc:
                raise ObjectCodecError(f"item {item.key!r}: {exc}") from None
            entries.append(ChunkEntry(item.key, 0, len(data), offset))
            parts.append(data)
            offset += len(data)
        return Chunk(entries=entries, raw=memoryview(b"".join(parts)))
