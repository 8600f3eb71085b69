"""Reading one copy of a step on every rank at once: each rank its own part, each stored byte once per node.

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

A node's part of a checkpoint (on a node-scoped tier, see :mod:`tiers.storage.nodeparts`) holds only the
files of that node's ranks, so there the shared regions and objects are read where their file is
(by the rank that wrote them, with the world size of the save) and sent over the whole group.

A rank alone (pipeline/solo.py) has nothing to share out: it reads the whole copy, straight into
the live tensors where they fit (tiers/reading/livefill.py), a bucket's copy where it is.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..providers.base import RankLocal, RestoreError
from ..providers.composite import CompositeProvider
from ..providers.fresh import is_fresh, spend
from ..providers.items import TensorItem
from ..tiers.format.dtypes import dtype_from_name
from ..tiers.reading.boxes import Box
from ..tiers.reading.stored import (
    CorruptCheckpointError,
    Location,
    MissingItemError,
    RankView,
    Region,
    StoredCheckpoint,
)
from .assign import balance
from .restore import Copy, fresh_read, require_providers
from .solo import RestoreGroup

RegionId = tuple[str, tuple[int, ...], tuple[int, ...]]  # stored key, box offsets, box shape
Offer = tuple[int, int | None]  # a shareable region's bytes, and the rank whose file alone holds it
Failure = tuple[int, str, str, bool]  # a rank that could not read its copy: rank, why, its tier, has it another
SLOT_ALIGN = 64

log = logging.getLogger("tierstate")


def _target_box(key: str, shape: tuple[int, ...], live: TensorItem | None) -> Box:
    """The box of the global tensor (of ``shape``) the live item holds: its shard, or the whole tensor."""
    if live is None or live.shard is None:
        return Box.whole(shape)
    if tuple(live.shard.global_shape) != shape:
        raise ValueError(
            f"item {key!r}: the checkpoint's global shape is {list(shape)}, "
            f"the live tensor's is {list(live.shard.global_shape)}"
        )
    return Box(tuple(live.shard.offsets), tuple(live.tensor.shape))


def _live_layouts(provider: CompositeProvider, view: RankView, keys: list[str]) -> dict[str, TensorItem]:
    """How this rank holds the saved tensors: as the live state describes them, else as the providers
    expect to (state that does not exist yet, such as a fresh optimizer's); a tensor absent is held whole."""
    live = {item.key: item for item in provider.describe() if isinstance(item, TensorItem)}
    stored = set(view.stored_keys(keys)) - set(live)
    unknown = {k: view.global_shape(k) for k in stored if view.tensor_record(k) is not None}
    return live | provider.restore_targets(unknown)


class CollectiveRead:
    """Reads a step on every rank at once, each rank its own part from its own copy."""

    def __init__(self, group: RestoreGroup, provider: CompositeProvider, allow_pickle: bool) -> None:
        self.group = group
        self.provider = provider
        self.allow_pickle = allow_pickle
        self.bytes_read = 0  # bytes this rank read from storage for the last copy
        self.kept: tuple[str, ...] = ()  # rank-local providers the last copy holds no state of this rank's for
        self.saved_world = 1  # how many ranks saved the last copy
        self.path: Path | None = None  # the last copy's directory (None for a bucket's)
        self.where = ""  # the last copy's location, for messages: its directory or its bucket prefix

    def read_step(
        self, step: int, copies: list[Copy], problems: list[str]
    ) -> tuple[str, Mapping[str, Any], tuple[str, ...]] | None:
        """This rank's state of ``step``, the tier it came from and the tier each rank read, or None if
        the ranks cannot read it.

        In rounds, all ranks together: each rank reads its part from its current copy; if every
        rank read cleanly, that is the state; otherwise each rank that failed moves on to its next
        copy (the others read theirs again), and once a failed rank has none left, the step is
        unreadable on every rank alike. Every failure is added to ``problems``, alike on every rank.
        """
        current = 0
        while True:
            name, location = copies[current]
            state, failed, served = self._read_copy(step, name, location, more=current + 1 < len(copies))
            if not failed:
                return name, state, served
            alone = self.group.world_size == 1
            problems += [f"step {step} on {'' if alone else f'rank {r}, '}tier {n}: {t}" for r, t, n, _ in failed]
            if not all(more for *_, more in failed):
                return None
            current += any(rank == self.group.rank for rank, *_ in failed)

    def _read_copy(
        self, step: int, name: str, location: Location, more: bool
    ) -> tuple[Mapping[str, Any], list[Failure], tuple[str, ...]]:
        """Collective: this rank's part of one copy (tier ``name``'s, at ``location``), exchanged over the node,
        or every rank's failure to read it; and the tier each rank read.

        ``more`` says whether this rank has another copy of the step to try; it travels with the failures.
        A rank alone reads the whole copy at once, straight into the live tensors where it can (nothing to
        share out: every region is its own).
        """
        where = f"restore step {step} from tier {name}"
        keys: list[str] = []
        view: RankView | None = None
        regions: dict[str, Region] = {}
        shared: dict[RegionId, Offer] = {}
        values: Mapping[str, Any] = {}
        problem: Exception | None = None
        with contextlib.ExitStack() as lock:
            try:
                # Locked: retention cannot delete it while it is being read.
                checkpoint = lock.enter_context(StoredCheckpoint.locked(location, step))
                self.path, self.where = checkpoint.directory, checkpoint.where
                where = f"restore step {step} from {checkpoint.where}"
                self.kept, self.saved_world = self._absent_rank_local(checkpoint), checkpoint.world_size
                require_providers(checkpoint, self.provider, where, leave_out=self.kept)
                keys = checkpoint.keys_of(set(self.provider.children) - set(self.kept))
                if self.group.world_size == 1:
                    values = self._read_whole(checkpoint, keys)
                else:
                    view, regions, shared = self._plan(checkpoint, keys)
            except Exception as exc:  # reported by every rank alike, below
                problem = exc
            across, ranks, owner, sizes, mine = False, self.group.node_ranks, {}, {}, []
            if self.group.world_size > 1:
                # A node's part lacks other nodes' files: then regions and objects travel over the whole group.
                across = any(self.group.all_gather(view is not None and view.node_part is not None, f"{where}: scope"))
                ranks = list(range(self.group.world_size)) if across else self.group.node_ranks
                gather = self.group.all_gather if across else self.group.node_all_gather
                offers = gather(shared, f"{where}: sharing out the reads")
                owner, sizes = _owners(dict(zip(ranks, offers, strict=True)))
                mine = [k for k, r in regions.items() if owner.get(_ident(r), self.group.rank) == self.group.rank]
            if view is not None:
                try:
                    values = self._read(view, keys, regions, mine)
                except Exception as exc:
                    problem = exc
            # A copy's fault sends its rank to the next copy; any other (a provider the checkpoint lacks, an
            # object refused by policy) would be the same with every copy: the restore fails, on every rank.
            refused = problem is not None and not isinstance(problem, StoredCheckpoint.COPY_ERRORS)
            if problem is not None and not refused:
                log.warning("restore step %d: copy on tier %s is unusable: %s", step, name, problem)
            text = None if problem is None else _told(problem, self.group.world_size)
            said = self.group.all_gather((text, name, more, refused), f"{where}: did every rank read its part")
            if any(refused for *_, refused in said):
                if problem is not None and self.group.world_size == 1:
                    raise problem
                texts = [f"rank {rank}: {text}" for rank, (text, *_, refused) in enumerate(said) if refused]
                raise RestoreError(f"{where}: {'; '.join(texts)}") from problem
            failed = [(rank, text, name, more) for rank, (text, name, more, _) in enumerate(said) if text is not None]
            served = tuple(name for _, name, *_ in said)
            if failed:
                return {}, failed, served
            if view is None:  # a rank alone: its whole copy is read
                return values, [], served
            exchanged = dict(values)
            self._exchange(where, regions, exchanged, owner, sizes, ranks)
            if across:
                self._exchange_objects(where, view, keys, exchanged)
        return {key: exchanged[view.stored_key(key)] for key in keys}, [], served

    def _read_whole(self, checkpoint: StoredCheckpoint, keys: list[str]) -> Mapping[str, Any]:
        """Every item of ``keys``, verified; the live tensors' read straight into them (``fill_live``)."""
        live = self.provider.restore_destinations()
        untouched = [key for key, tensor in live.items() if is_fresh(tensor)]
        read = checkpoint.fill_live(live, keys, allow_pickle=self.allow_pickle, fresh=untouched)
        spend(live[key] for key in untouched)  # filled now (or about to be, by read.fill): restored state
        self.bytes_read = checkpoint.stored_bytes
        return fresh_read(read.values, read.fill)

    def _absent_rank_local(self, checkpoint: StoredCheckpoint) -> tuple[str, ...]:
        """The rank-local providers (providers/base.py, ``RankLocal``) this rank reads nothing for: the
        checkpoint was saved by fewer ranks, none of them this one (kept as they are, or derived after the
        restore). One whose ``missing_rank`` is ``"error"`` fails this copy instead (alike on every rank of
        that kind, reported by all)."""
        rank, saved = self.group.rank, checkpoint.world_size
        if rank < saved:
            return ()
        local = {n: c for n, c in self.provider.children.items() if isinstance(c, RankLocal)}
        refused = sorted(n for n, c in local.items() if c.missing_rank == "error")
        if refused:
            raise MissingItemError(
                f"rank {rank}: {', '.join(map(repr, refused))} hold(s) each rank's own state, and step "
                f"{checkpoint.step} was saved by {saved} rank(s), none of them rank {rank}; another rank's would "
                "be a duplicate (missing_rank='keep' keeps this rank's own instead)"
            )
        return tuple(sorted(local))

    def _plan(
        self, checkpoint: StoredCheckpoint, keys: list[str]
    ) -> tuple[RankView, dict[str, Region], dict[RegionId, Offer]]:
        """This rank's view, its tensor regions by stored key, and the shareable ones (see :data:`Offer`)."""
        view = checkpoint.view(self.group.rank, keys)
        live = _live_layouts(self.provider, view, keys)
        regions: dict[str, Region] = {}
        for key in sorted(view.stored_keys(keys)):
            if view.tensor_record(key) is not None:  # a rank's view resolves aliases and ranks
                regions[key] = view.region(key, _target_box(key, view.global_shape(key), live.get(key)))
        shared = {
            _ident(region): (region.box.numel * dtype_from_name(region.record.dtype).itemsize, view.writer(region))
            for key, region in regions.items()
            if not view.is_per_rank(key)
        }
        return view, regions, shared

    def _read(self, view: RankView, keys: list[str], regions: dict[str, Region], mine: list[str]) -> dict[str, Any]:
        objects = sorted(key for key in set(view.stored_keys(keys)) - set(regions) if view.holds_bytes_of(key))
        values = view.read(objects, allow_pickle=self.allow_pickle) if objects else {}
        tensors = view.read_regions([regions[key] for key in mine])
        self.bytes_read = tensors.bytes_read
        return values | dict(zip(mine, tensors.tensors, strict=True))

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

    def _exchange_objects(self, where: str, view: RankView, keys: list[str], values: dict[str, Any]) -> None:
        """A node's part: each rank sends the objects it wrote, so every rank has those from other nodes."""
        objects = set(view.stored_keys(keys)) - set(values)
        sent = {key: value for key, value in values.items() if view.writer_of(key) == self.group.rank}
        for got in self.group.all_gather(sent, f"{where}: receiving the objects of other nodes"):
            values |= {key: value for key, value in got.items() if key in objects}
        missing = sorted(objects - set(values))
        if missing:
            raise CorruptCheckpointError(f"{where}: no rank holds the file of object(s) {', '.join(missing)}")


def _layout(share: list[RegionId], sizes: dict[RegionId, int]) -> tuple[list[tuple[RegionId, int]], int]:
    """Where each region sits in a broadcast buffer: aligned, so each can be viewed as its dtype."""
    slots, offset = [], 0
    for ident in share:
        slots.append((ident, offset))
        offset += -(-sizes[ident] // SLOT_ALIGN) * SLOT_ALIGN
    return slots, offset


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
    owner = {ident: writer for ident in common if (writer := writers[ident]) is not None and writer in holders[ident]}
    load: dict[int, int] = defaultdict(int)
    for ident, rank in owner.items():
        load[rank] += sizes[ident]
    owner |= balance({i: sizes[i] for i in common if i not in owner}, holders, load)
    return owner, sizes


def _told(problem: BaseException, ranks: int) -> str:
    """``problem`` as the other ranks hear of it: with its type among many, as it reads for one."""
    return str(problem) if ranks == 1 else f"{type(problem).__name__}: {problem}"


def _ident(region: Region) -> RegionId:
    return region.key, region.box.offsets, region.box.shape
