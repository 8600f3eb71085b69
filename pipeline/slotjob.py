"""A checkpoint captured straight into the memory tier's files: which runners do it, where each chunk lies in
a rank's slot, and the windows capture copies into.

With a memory tier as the persist tier, the host cache and the write are a copy too many: capture
copies each chunk of tensor bytes into the rank's slot (tiers/storage/slots.py: the data file,
preallocated and mapped) at the offset its frame has, and persist only records the frame
(tiers/format/slotfile.py). The layout is the one the frames container would give the same chunks
(each at the next ``align`` boundary, in plan order), so restore, verify, flush and the CLI read the
file as any other; the objects' frames follow the tensor frames.

Slots need what that layout assumes: the frames container (not HDF5) and the raw bytes stored as
captured (no compression). A runner whose persist tier is no memory tier, or whose pipeline stores
other bytes, writes through the host cache as before; ``tiers.NAME.slots: false`` asks for that too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..tiers.format.slotfile import SlotRegion
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.hostcache import Slab
from ..tiers.storage.slots import PAGE, Slot, SlotPool
from .config import PipelineConfig
from .units import ChunkPlan


def uses_slots(config: PipelineConfig) -> bool:
    """Whether this config's checkpoints are captured into the persist tier's slots (see the module docstring)."""
    tier = config.tiers[config.persist_tier]
    persist, compress = config.stage_of_kind("persist"), config.stage_of_kind("compress")
    return (
        tier.kind == "memory"
        and tier.slots is not False
        and persist is not None
        and persist.format == "frames"
        and (compress is None or compress.codec == "none")
    )


def slot_pool(config: PipelineConfig, tier: FilesystemTier, rank: int, pin: bool) -> SlotPool | None:
    """This rank's slot pool on ``tier`` (the persist tier) when the config captures into slots, else None."""
    if not uses_slots(config):
        return None
    keep = config.tiers[tier.name].retention.keep_last or 1
    return SlotPool(tier.name, tier.root, rank, keep, pin)


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


@dataclass(frozen=True)
class SlotLayout:
    """Where each chunk of a plan goes in the slot: ``windows[chunk index] = (offset, captured bytes, end)``,
    ``end`` being where the next frame starts (the bytes between are alignment padding, kept zero); ``size``
    is the slot's length (the end of the last frame, up to a whole page)."""

    windows: dict[int, tuple[int, int, int]]
    size: int

    @classmethod
    def of(cls, chunks: list[ChunkPlan], align: int) -> SlotLayout:
        starts, offset = [], 0
        for chunk in chunks:
            starts.append(offset)
            offset = _align_up(offset + chunk.nbytes, align)
        size = _align_up(starts[-1] + chunks[-1].nbytes, PAGE)
        ends = [*starts[1:], size]
        windows = {c.index: (start, c.nbytes, end) for c, start, end in zip(chunks, starts, ends, strict=True)}
        return cls(windows, size)

    def region(self, slot: Slot) -> SlotRegion:
        """The tensor frames as the slot's container records them, in plan order."""
        frames = [(offset, nbytes) for offset, nbytes, _ in self.windows.values()]
        return SlotRegion(frames, slot.tensor.data_ptr(), slot.size)


class SlotWindows:
    """Capture's destinations in one checkpoint's slot (lying at ``path`` meanwhile): each chunk's window of the
    mapping, as a slab."""

    def __init__(self, slot: Slot, layout: SlotLayout, path: Path) -> None:
        self.slot = slot
        self.path = path
        self._layout = layout

    def take(self, plan: ChunkPlan) -> Slab:
        """The window of ``plan``'s chunk, the padding after its bytes zeroed: the file holds no stale bytes of
        an older checkpoint between frames (a few KiB; numpy, not torch: no OpenMP team from this thread)."""
        offset, nbytes, end = self._layout.windows[plan.index]
        window = self.slot.tensor[offset:end]
        if end > offset + nbytes:
            window[nbytes:].numpy().fill(0)
        return Slab(plan.index, window)

