"""The compress stage: a chunk's bytes zstd-compressed (byte-shuffled first), kept only if smaller.

With ``codec: none`` every unit goes past it, as does an empty chunk. With a host cache that has
scratch slabs, a chunk held in a slab is shuffled into a scratch slab and its frame streamed back into
its own slab, so compression allocates nothing outside the host cache; otherwise the compressed copy
is a new buffer and the chunk's slab is given back at once.
"""

from __future__ import annotations

from ...tiers.format import codecs
from ..config_stages import CompressStage
from ..stage_threads import Stopped
from ..units import Chunk, Unit
from .slabs import HeldSlabs


class Compress:
    def __init__(self, config: CompressStage, slabs: HeldSlabs) -> None:
        self._config = config
        self._slabs = slabs

    def passes(self, unit: Unit) -> bool:
        return self._config.codec == "none" or (isinstance(unit, Chunk) and not len(unit.raw))

    def run(self, unit: Unit) -> Unit:
        if not isinstance(unit, Chunk):
            return unit  # serialize hands on only chunks
        config = self._config
        width = unit.element_size if config.shuffle == "auto" else 1
        cache = self._slabs.cache
        if unit.slab is not None and cache.scratch_count:
            scratch = cache.acquire_scratch(self._slabs.flow.stopped)
            if scratch is None:
                raise Stopped
            try:
                done = codecs.compress_into(unit.raw, scratch.tensor, config.level, config.threads, width)
            finally:
                cache.release_scratch(scratch)
            if done is not None:
                unit.stored, unit.codec, unit.shuffle = unit.slab.view(done[0]), "zstd", done[1]
            return unit
        packed = codecs.compress(unit.raw, config.level, config.threads, width)
        if packed is not None:
            unit.stored, unit.codec, unit.shuffle = packed.data, packed.codec, packed.shuffle
            if unit.slab is not None:
                self._slabs.give_back(unit.slab)  # the compressed copy is independent: free the slab early
                unit.slab = None
        return unit
