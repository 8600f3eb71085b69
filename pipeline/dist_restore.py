"""Restore on many ranks: each rank gets its own state, each stored byte is read once per node.

What a rank needs is a list of regions, one per tensor item: a box of a stored tensor, the whole of
it for a replicated item, this rank's shard (cut from however the checkpoint was sharded) for a
sharded one. A region only this rank needs (its shard, its per-rank RNG state) it reads itself;
so with the world size of the save every shard is read exactly once in the whole job. A region
several ranks of one node need (replicated parameters and optimizer state) is read by one of
them and broadcast over the node's gloo group: by the rank that wrote it when that rank is on
the node (so with the world size of the save each rank reads back exactly its own data file,
whose frames also hold its shards and per-rank state), otherwise by the node's ranks in shares
balanced by bytes. Frames are the unit of reading (a checksum covers a whole frame), which is
why keeping a frame's readers to one rank matters.

Why split-then-broadcast rather than one reader per node: the reads, checksums and copies of the
shared bytes are spread over every rank (as the writes were), and the node's storage sees each
byte once either way. Objects (small Python values) are read by every rank that needs them.

A node's part of a checkpoint (on a node-scoped tier, see :mod:`tiers.nodeparts`) holds only the
files of that node's ranks, so there the shared regions and objects are read where their file is
(by the rank that wrote them, with the world size of the save) and sent over the whole group.

Every step of the way is agreed on: rank 0 picks the step, and a copy is used only if every rank
read its part of it cleanly, so all ranks restore the same step from the same tier or all fail.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ..providers.composite import CompositeProvider
from ..providers.items import TensorItem
from ..tiers.boxes import Box
from ..tiers.dtypes import dtype_from_name
from ..tiers.filesystem import FilesystemTier
from ..tiers.format import Manifest, ObjectRecord, PerRankRecord, stored_key
from ..tiers.multirank import rank_view
from ..tiers.names import data_file_rank
from ..tiers.reader import CorruptCheckpointError, read_items
from ..tiers.reshard import Region, global_shape, read_regions, source_files
from .assign import balance
from .distributed import CheckpointGroup
from .restore import NoCheckpointError, RestoreResult, resolve_step, restore_into

RegionId = tuple[str, tuple[int, ...], tuple[int, ...]]  # stored key, box offsets, box shape
Offer = tuple[int, int | None]  # a shareable region's bytes, and the rank whose file alone holds it
SLOT_ALIGN = 64


def restore_across_ranks(
    group: CheckpointGroup,
    provider: CompositeProvider,
    tiers: list[FilesystemTier],
    which: int | str,
    allow_pickle: bool,
    fallback: bool = False,
) -> RestoreResult:
    """Every rank restores the same step, rank 0's choice, each getting its own part of it."""
    choice: int | tuple[str, str] | None = None
    if group.is_leader:
        try:
            choice = resolve_step(tiers, which)
        except (NoCheckpointError, ValueError) as exc:
            choice = (type(exc).__name__, str(exc))
    choice = group.from_leader(choice, "restore: choosing the step")
    if isinstance(choice, tuple):
        kind, message = choice
        raise (NoCheckpointError if kind == NoCheckpointError.__name__ else ValueError)(f"rank 0: {message}")
    reader = _CollectiveRead(group, provider, allow_pickle)
    result = restore_into(provider, tiers, choice, allow_pickle, fallback=fallback, read=reader)
    return dataclasses.replace(result, bytes_read=reader.bytes_read)  # this rank's reads, not the whole copy


def _target_box(key: str, record: Any, live: TensorItem | None) -> Box:
    """The box of the global tensor the live item holds: its shard, or the whole tensor."""
    shape = global_shape(record)
    if live is None or live.shard is None:
        return Box.whole(shape)
    if tuple(live.shard.global_shape) != shape:
        raise ValueError(
            f"item {key!r}: the checkpoint's global shape is {list(shape)}, "
            f"the live tensor's is {list(live.shard.global_shape)}"
        )
    return Box(tuple(live.shard.offsets), tuple(live.tensor.shape))


def _live_layouts(provider: CompositeProvider, view: Manifest, keys: list[str]) -> dict[str, TensorItem]:
    """How this rank holds the saved tensors: as the live state describes them, else as the providers
    expect to (state that does not exist yet, such as a fresh optimizer's); a tensor absent is held whole."""
    live = {item.key: item for item in provider.describe() if isinstance(item, TensorItem)}
    stored = {stored_key(k, view.items[k]) for k in keys} - set(live)
    unknown = {k: global_shape(view.items[k]) for k in stored if not isinstance(view.items[k], ObjectRecord)}
    return live | provider.restore_targets(unknown)


class _CollectiveRead:
    """Reads one copy on every rank at once (a :data:`pipeline.restore.CopyReader`)."""

    def __init__(self, group: CheckpointGroup, provider: CompositeProvider, allow_pickle: bool) -> None:
        self.group = group
        self.provider = provider
        self.allow_pickle = allow_pickle
        self.bytes_read = 0  # tensor bytes this rank read from storage for the last copy

    def __call__(self, directory: Path, manifest: Manifest, keys: list[str]) -> dict[str, Any]:
        where = f"restore step {manifest.step} from {directory}"
        try:
            view, regions, shared = self._plan(manifest, keys)
            problem = None
        except Exception as exc:  # reported by every rank alike, below
            view, regions, shared, problem = manifest, {}, {}, exc
        across = manifest.node_part is not None  # other nodes' files are not in this node's part
        ranks = list(range(self.group.world_size)) if across else self.group.node_ranks
        gather = self.group.all_gather if across else self.group.node_all_gather
        offers = gather(shared, f"{where}: sharing out the reads")
        owner, sizes = _owners(dict(zip(ranks, offers, strict=True)))
        mine = [key for key, region in regions.items() if owner.get(_ident(region), self.group.rank) == self.group.rank]
        values: dict[str, Any] = {}
        if problem is None:
            try:
                values = self._read(directory, view, keys, regions, mine)
            except Exception as exc:
                problem = exc
        self._agree(where, problem)
        self._exchange(where, regions, values, owner, sizes, ranks)
        if across:
            self._exchange_objects(where, view, keys, values)
        return {key: values[stored_key(key, view.items[key])] for key in keys}

    def _plan(self, manifest: Manifest, keys: list[str]) -> tuple[Manifest, dict[str, Region], dict[RegionId, Offer]]:
        """This rank's view, its tensor regions by stored key, and the shareable ones (see :data:`Offer`)."""
        view = rank_view(manifest, self.group.rank, keys)
        live = _live_layouts(self.provider, view, keys)
        regions: dict[str, Region] = {}
        for key in sorted({stored_key(k, view.items[k]) for k in keys}):
            record = view.items[key]
            if not isinstance(record, ObjectRecord):
                regions[key] = Region(key, record, _target_box(key, record, live.get(key)))
        shared = {
            _ident(region): (region.box.numel * dtype_from_name(region.record.dtype).itemsize, _writer(region))
            for key, region in regions.items()
            if not isinstance(manifest.items[key], PerRankRecord)
        }
        return view, regions, shared

    def _read(
        self, directory: Path, view: Manifest, keys: list[str], regions: dict[str, Region], mine: list[str]
    ) -> dict[str, Any]:
        objects = sorted(key for key in {stored_key(k, view.items[k]) for k in keys} - set(regions) if _here(view, key))
        values = read_items(directory, view, objects, allow_pickle=self.allow_pickle) if objects else {}
        tensors = read_regions(directory, view, [regions[key] for key in mine])
        self.bytes_read = tensors.bytes_read
        return values | dict(zip(mine, tensors.tensors, strict=True))

    def _agree(self, where: str, problem: BaseException | None) -> None:
        """Go on only if every rank read its part; otherwise all fail alike, naming who and why."""
        said = self.group.all_gather(None if problem is None else f"{type(problem).__name__}: {problem}", where)
        failures = [f"rank {rank}: {text}" for rank, text in enumerate(said) if text is not None]
        if failures:
            raise CorruptCheckpointError(f"{where}: {'; '.join(failures)}")

    def _exchange(
        self,
        where: str,
        regions: dict[str, Region],
        values: dict[str, Any],
        owner: dict[RegionId, int],
        sizes: dict[RegionId, int],
        ranks: list[int],
    ) -> None:
        """Each of ``ranks`` (the node's, or all) broadcasts the shared regions it read, packed into one
        buffer, to the others."""
        wanted = {_ident(region): key for key, region in regions.items()}
        across = len(ranks) > len(self.group.node_ranks)
        for src in ranks:
            share = sorted(ident for ident, rank in owner.items() if rank == src)
            if not share:
                continue
            slots, total = _layout(share, sizes)
            buffer = torch.empty(total, dtype=torch.uint8)
            if src == self.group.rank:
                for ident, offset in slots:
                    buffer[offset : offset + sizes[ident]] = values[wanted[ident]].reshape(-1).view(torch.uint8)
            send = self.group.broadcast if across else self.group.node_broadcast
            send(buffer, src, f"{where}: receiving the reads of rank {src}")
            for ident, offset in slots:
                if src != self.group.rank and ident in wanted:
                    region = regions[wanted[ident]]
                    raw = buffer[offset : offset + sizes[ident]]
                    values[wanted[ident]] = raw.view(dtype_from_name(region.record.dtype)).reshape(region.box.shape)


    def _exchange_objects(self, where: str, view: Manifest, keys: list[str], values: dict[str, Any]) -> None:
        """A node's part: each rank sends the objects it wrote, so every rank has those from other nodes."""
        objects = {stored_key(k, view.items[k]) for k in keys} - set(values)
        sent = {
            key: value
            for key, value in values.items()
            if isinstance(view.items[key], ObjectRecord) and _writer_of(view, key) == self.group.rank
        }
        for got in self.group.all_gather(sent, f"{where}: receiving the objects of other nodes"):
            values |= {key: value for key, value in got.items() if key in objects}
        missing = sorted(objects - set(values))
        if missing:
            raise CorruptCheckpointError(f"{where}: no rank holds the file of object(s) {', '.join(missing)}")


def _here(view: Manifest, key: str) -> bool:
    """Whether the bytes of stored item ``key`` are in the files of this copy (a node's part lacks some)."""
    record = view.items[key]
    return not isinstance(record, ObjectRecord) or all(piece.file in view.files for piece in record.pieces)


def _writer_of(view: Manifest, key: str) -> int | None:
    """The rank whose data file holds object ``key``."""
    record = view.items[key]
    files = {piece.file for piece in record.pieces} if isinstance(record, ObjectRecord) else set()
    return data_file_rank(next(iter(files))) if len(files) == 1 else None


def _layout(share: list[RegionId], sizes: dict[RegionId, int]) -> tuple[list[tuple[RegionId, int]], int]:
    """Where each region sits in a broadcast buffer: aligned, so each can be viewed as its dtype."""
    slots, offset = [], 0
    for ident in share:
        slots.append((ident, offset))
        offset += -(-sizes[ident] // SLOT_ALIGN) * SLOT_ALIGN
    return slots, offset


def _writer(region: Region) -> int | None:
    """The rank that wrote all of the region's bytes (they are in its data file), or None."""
    files = source_files(region)
    return data_file_rank(next(iter(files))) if len(files) == 1 else None


def _owners(offers: dict[int, dict[RegionId, Offer]]) -> tuple[dict[RegionId, int], dict[RegionId, int]]:
    """Who reads each region several ranks of the node need, and the bytes of every shareable region.

    The rank that wrote a region reads it when it is on the node and needs it too: its own
    per-rank items and shards lie in the same frames, so each frame is read once. The others
    (resharding, another node's file) are spread by bytes.
    """
    holders: dict[RegionId, list[int]] = defaultdict(list)
    sizes: dict[RegionId, int] = {}
    writers: dict[RegionId, int | None] = {}
    for rank, offer in offers.items():
        for ident, (nbytes, writer) in offer.items():
            holders[ident].append(rank)
            sizes[ident], writers[ident] = nbytes, writer
    common = [ident for ident, ranks in holders.items() if len(ranks) > 1]
    owner = {ident: writers[ident] for ident in common if writers[ident] in holders[ident]}
    load: dict[int, int] = defaultdict(int)
    for ident, rank in owner.items():
        load[rank] += sizes[ident]
    owner |= balance({i: sizes[i] for i in common if i not in owner}, holders, load)
    return owner, sizes


def _ident(region: Region) -> RegionId:
    return region.key, region.box.offsets, region.box.shape
