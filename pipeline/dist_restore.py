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

Every step of the way is agreed on, so that no rank is ever left waiting in a collective: the
ranks exchange which steps their tiers hold and take the newest one every rank holds (tiers may
differ between ranks: a node's own NVMe, a shared PFS); a copy is used only if every rank read its
part of it cleanly (a rank that could not moves on to its next copy of the step); and the
providers are restored only if every rank's check passed, and kept only if every rank's restore
succeeded. So all ranks restore the same step or all fail with the same error.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..providers.base import RankLocal, RestoreError
from ..providers.composite import CompositeProvider
from ..providers.items import TensorItem
from ..tiers.boxes import Box
from ..tiers.dtypes import dtype_from_name
from ..tiers.filesystem import FilesystemTier
from ..tiers.stored import CorruptCheckpointError, MissingItemError, RankView, Region, StoredCheckpoint
from .assign import balance
from .distributed import CheckpointGroup
from .restore import (
    NoCheckpointError,
    NothingToRestoreError,
    RestoreResult,
    candidate_steps,
    checked_target,
    lost_entries,
    require_providers,
    unusable,
)

RegionId = tuple[str, tuple[int, ...], tuple[int, ...]]  # stored key, box offsets, box shape
Offer = tuple[int, int | None]  # a shareable region's bytes, and the rank whose file alone holds it
Failure = tuple[int, str, str, bool]  # a rank that could not read its copy: rank, why, its tier, has it another
SLOT_ALIGN = 64

log = logging.getLogger("tierstate")


def restore_across_ranks(
    group: CheckpointGroup,
    provider: CompositeProvider,
    tiers: list[FilesystemTier],
    which: int | str,
    allow_pickle: bool,
    fallback: bool = False,
) -> RestoreResult:
    """Every rank restores the same step, each getting its own part of it, or every rank fails alike.

    The ranks first tell each other which steps their tiers hold and restore the newest one all
    hold (or ``which``); each rank reads it from its own fastest copy. A copy a rank cannot read
    sends that rank to its next copy of the step while the others read theirs again.
    """
    holdings = group.all_gather(_Holdings.of(tiers, which, fallback), "restore: which steps each rank holds")
    wanted, candidates, problems = _agreed_candidates(holdings)
    reader = _CollectiveRead(group, provider, allow_pickle)
    for step in candidates:
        started = time.perf_counter()
        copies = [tier for tier in tiers if step in holdings[group.rank].steps[tier.name]]
        read = reader.read_step(step, copies, problems)
        if read is None:
            continue
        tier, state, served = read
        if problems:
            log.warning("restore: %s; restoring step %d", "; ".join(problems), step)
        kept = reader.kept
        restored = CompositeProvider(**{n: c for n, c in provider.children.items() if n not in kept})
        _apply_on_every_rank(group, restored, state, f"restore step {step}")
        for name in kept:
            log.warning("restore step %d: rank %d keeps its own %r: the checkpoint holds no state of this rank's",
                        step, group.rank, name)  # fmt: skip
        seconds = time.perf_counter() - started
        # bytes_read: this rank's reads, not the whole copy
        return RestoreResult(
            step, tier.name, tier.step_dir(step), reader.bytes_read, seconds, tuple(problems), served, kept,
            source=str(tier.step_dir(step)),
        )  # fmt: skip
    raise NoCheckpointError(unusable(wanted, fallback, problems))


@dataclass(frozen=True)
class _Holdings:
    """What one rank asks to restore and which committed steps each of its tiers holds, sent to every rank."""

    which: int | str
    fallback: bool
    steps: dict[str, list[int]]  # by tier name
    roots: dict[str, str]
    unlisted: dict[str, str]  # the tiers this rank could not list, and why (taken as holding nothing)
    lost: tuple[tuple[int, str], ...] = ()  # step-N entries that are no checkpoint (a lost manifest), and why

    @classmethod
    def of(cls, tiers: list[FilesystemTier], which: int | str, fallback: bool) -> _Holdings:
        steps, unlisted, lost = {}, {}, []
        for tier in tiers:
            try:
                steps[tier.name] = tier.steps()
                lost += lost_entries([tier])
            except OSError as exc:
                steps[tier.name], unlisted[tier.name] = [], f"{type(exc).__name__}: {exc}"
        return cls(which, fallback, steps, {t.name: str(t.root) for t in tiers}, unlisted, tuple(lost))

    @property
    def held(self) -> set[int]:
        return {step for steps in self.steps.values() for step in steps}

    def __str__(self) -> str:
        shown = (f"{name}={self.roots[name]} {self.unlisted.get(name, steps)}" for name, steps in self.steps.items())
        return ", ".join(shown)


def _agreed_candidates(holdings: list[_Holdings]) -> tuple[int, list[int], list[str]]:
    """The step asked for, the steps to try in order, and why newer ones are left out.

    Computed alike on every rank from the same holdings, so every rank goes on or every rank
    raises the same error, naming what each rank holds.
    """
    if len({(h.which, h.fallback) for h in holdings}) > 1:
        each = ", ".join(f"rank {r}: ({h.which!r}, fallback={h.fallback})" for r, h in enumerate(holdings))
        raise ValueError(f"restore: the ranks asked for different checkpoints: {each}")
    which, fallback = holdings[0].which, holdings[0].fallback
    held = [h.held for h in holdings]
    anyone, everyone = set.union(*held), set.intersection(*held)
    by_rank = "; ".join(f"rank {r}: {h}" for r, h in enumerate(holdings))
    if checked_target(which) == "latest":
        if not anyone:
            raise NothingToRestoreError(f"no committed checkpoint on any tier of any rank ({by_rank})")
        if not everyone:
            raise NoCheckpointError(f"restore latest: no step is committed on a tier of every rank ({by_rank})")
    wanted = candidate_steps(everyone, which, fallback)[0]
    problems = []
    skipped = {s for s in anyone if s > wanted} if which == "latest" else set()  # newer steps some rank lacks
    for step in sorted(skipped | {wanted}):
        lacking = [str(rank) for rank, steps in enumerate(held) if step not in steps]
        if lacking:
            problems.append(f"step {step} is not on every rank: rank(s) {', '.join(lacking)} lack it")
    if which == "latest":  # one rule with one rank (restore.refuse_lost_newer), agreed from the same holdings
        newer = [f"rank {rank}: {text}" for rank, h in enumerate(holdings) for step, text in h.lost if step > wanted]
        if newer and not fallback:
            raise NoCheckpointError(
                f"cannot restore the latest step: {'; '.join(newer)}; restore(..., fallback=True) takes the newest "
                f"older step ({wanted}) and reports the one(s) passed over"
            )
        problems = newer + problems
    candidates = [step for step in candidate_steps(everyone, wanted, fallback) if step in everyone]
    if not candidates:
        raise NoCheckpointError(f"{unusable(wanted, fallback, problems)} ({by_rank})")
    return wanted, candidates, problems


def _apply_on_every_rank(group: CheckpointGroup, provider: CompositeProvider, state: dict, where: str) -> None:
    """Check, then restore, on every rank in agreed steps: if any rank fails one, every rank is left as it was.

    The providers without ``check`` are restored (and can be put back) before the checked ones, which
    promised to succeed and so are restored only once every rank restored the others.
    """
    restoring = provider.restoring(state)
    _agree(group, f"{where}: checking the state", _attempt(restoring.check))
    for what, step in (
        ("the providers without check", restoring.restore_unchecked),
        ("the others", restoring.restore_checked),
    ):
        problem = _attempt(step)  # a rank that fails here has already put its providers back
        try:
            _agree(group, f"{where}: restoring {what}", problem)
        except RestoreError as exc:
            if problem is None:  # this rank restored, another did not: go back too
                for note in restoring.undo():
                    exc.add_note(note)
            raise


def _attempt(step: Callable[[], None]) -> Exception | None:
    try:
        step()
    except Exception as exc:  # reported on every rank alike by _agree
        return exc
    return None


def _agree(group: CheckpointGroup, where: str, problem: BaseException | None) -> None:
    """Go on only if every rank succeeded; otherwise every rank raises a RestoreError naming who failed and why."""
    said = group.all_gather(None if problem is None else f"{type(problem).__name__}: {problem}", where)
    failures = [f"rank {rank}: {text}" for rank, text in enumerate(said) if text is not None]
    if failures:
        raise RestoreError(f"{where}: {'; '.join(failures)}") from problem


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


class _CollectiveRead:
    """Reads a step on every rank at once, each rank its own part from its own copy."""

    def __init__(self, group: CheckpointGroup, provider: CompositeProvider, allow_pickle: bool) -> None:
        self.group = group
        self.provider = provider
        self.allow_pickle = allow_pickle
        self.bytes_read = 0  # tensor bytes this rank read from storage for the last copy
        self.kept: tuple[str, ...] = ()  # rank-local providers the last copy holds no state of this rank's for

    def read_step(
        self, step: int, copies: list[FilesystemTier], problems: list[str]
    ) -> tuple[FilesystemTier, dict[str, Any], tuple[str, ...]] | None:
        """This rank's state of ``step``, the tier it came from and the tier each rank read, or None if
        the ranks cannot read it.

        In rounds, all ranks together: each rank reads its part from its current copy; if every
        rank read cleanly, that is the state; otherwise each rank that failed moves on to its next
        copy (the others read theirs again), and once a failed rank has none left, the step is
        unreadable on every rank alike. Every failure is added to ``problems``, alike on every rank.
        """
        current = 0
        while True:
            tier = copies[current]
            state, failed, served = self._read_copy(step, tier, more=current + 1 < len(copies))
            if not failed:
                return tier, state, served
            problems += [f"step {step} on rank {rank}, tier {name}: {text}" for rank, text, name, _ in failed]
            if not all(more for *_, more in failed):
                return None
            current += any(rank == self.group.rank for rank, *_ in failed)

    def _read_copy(
        self, step: int, tier: FilesystemTier, more: bool
    ) -> tuple[dict[str, Any], list[Failure], tuple[str, ...]]:
        """Collective: this rank's part of one copy, exchanged over the node, or every rank's failure to read
        it; and the tier each rank read.

        ``more`` says whether this rank has another copy of the step to try; it travels with the failures.
        """
        directory = tier.step_dir(step)
        where = f"restore step {step} from {directory}"
        keys: list[str] = []
        view: RankView | None = None
        regions: dict[str, Region] = {}
        shared: dict[RegionId, Offer] = {}
        problem: Exception | None = None
        with contextlib.ExitStack() as lock:
            try:
                # Locked: retention cannot delete it while it is being read.
                checkpoint = lock.enter_context(StoredCheckpoint.locked(directory, step))
                self.kept = self._absent_rank_local(checkpoint)
                require_providers(checkpoint, self.provider, where, leave_out=self.kept)
                keys = checkpoint.keys_of(set(self.provider.children) - set(self.kept))
                view, regions, shared = self._plan(checkpoint, keys)
            except Exception as exc:  # reported by every rank alike, below
                problem = exc
            # A node's part lacks other nodes' files: then regions and objects travel over the whole group.
            across = any(self.group.all_gather(view is not None and view.node_part is not None, f"{where}: scope"))
            ranks = list(range(self.group.world_size)) if across else self.group.node_ranks
            gather = self.group.all_gather if across else self.group.node_all_gather
            offers = gather(shared, f"{where}: sharing out the reads")
            owner, sizes = _owners(dict(zip(ranks, offers, strict=True)))
            mine = [k for k, region in regions.items() if owner.get(_ident(region), self.group.rank) == self.group.rank]
            values: dict[str, Any] = {}
            if view is not None:
                try:
                    values = self._read(view, keys, regions, mine)
                except Exception as exc:
                    problem = exc
            if problem is not None:
                log.warning("restore step %d: copy on tier %s is unusable: %s", step, tier.name, problem)
            text = None if problem is None else f"{type(problem).__name__}: {problem}"
            said = self.group.all_gather((text, tier.name, more), f"{where}: did every rank read its part")
            failed = [(rank, text, name, more) for rank, (text, name, more) in enumerate(said) if text is not None]
            served = tuple(name for _, name, _ in said)
            if failed:
                return {}, failed, served
            assert view is not None  # every rank read its part, so every rank has its view
            self._exchange(where, regions, values, owner, sizes, ranks)
            if across:
                self._exchange_objects(where, view, keys, values)
        return {key: values[view.stored_key(key)] for key in keys}, [], served

    def _absent_rank_local(self, checkpoint: StoredCheckpoint) -> tuple[str, ...]:
        """The rank-local providers (providers/base.py, ``RankLocal``) this rank keeps as they are: the
        checkpoint was saved by fewer ranks, none of them this one. One whose ``missing_rank`` is
        ``"error"`` fails this copy instead (alike on every rank of that kind, reported by all)."""
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


def _ident(region: Region) -> RegionId:
    return region.key, region.box.offsets, region.box.shape
