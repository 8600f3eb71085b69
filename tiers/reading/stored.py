"""One stored checkpoint as one object: what every reader outside the reading layers takes.

Like DCP's ``StorageReader``, a :class:`StoredCheckpoint` owns where the checkpoint is (a
:class:`~tiers.reading.source.ByteSource`: a directory or a bucket prefix), its manifest (read and
validated once, checked against the step it was asked for), the read lock that keeps retention from
deleting it meanwhile, and a rank's view of it (:class:`RankView`). Readers (restore on one rank or
many, export, the HF directory, the CLI, the DCP and HF integrations) ask it for items, regions of
sharded tensors and the layout to reshard by, and never handle manifests, rank views, stored keys or
the reading modules below (:mod:`tiers.format.format`, :mod:`tiers.reading.pieces`, :mod:`tiers.format.multirank`,
:mod:`tiers.reading.reshard`, :mod:`tiers.reading.reader`). Every byte handed out was verified against its frame's
checksum on the way (the reading layers' contract).

Typical use::

    with StoredCheckpoint.locked(tier.step_dir(step), step) as checkpoint:
        state = checkpoint.read(keys, allow_pickle=False)
    # a copy at fault raises one of StoredCheckpoint.COPY_ERRORS: try the next copy
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from ..format.convert import batches
from ..format.format import ManifestError, MissingItemError, read_manifest
from ..format.gcpause import gc_paused
from ..format.manifest import Manifest, NodePart
from ..format.multirank import rank_view
from ..format.names import data_file_rank
from ..format.records import AnyRecord, ObjectRecord, PerRankRecord, ShardedRecord, TensorRecord, stored_key
from .boxes import Box
from .integrity import Problem, admit, verify_source
from .livefill import LiveFill, plan
from .pieces import CorruptCheckpointError, read_records
from .reader import COPY_ERRORS, read_view
from .reshard import Region, RegionsRead, global_shape, read_regions, source_files
from .source import ByteSource, as_source

Location = Path | ByteSource  # where a stored checkpoint is: a step directory, or a bucket prefix's source

__all__ = [
    "COPY_ERRORS",
    "CorruptCheckpointError",
    "LiveRead",
    "Location",
    "MissingItemError",
    "RankView",
    "Region",
    "StoredCheckpoint",
    "load",
]


@dataclass
class LiveRead:
    """What :meth:`RankView.fill_live` read: ``values`` by key, of which the live tensors it was given
    (not yet holding the checkpoint's bytes: every frame of them verified, none read in) until
    ``fill`` (None if none qualified) has run; see tiers/reading/livefill.py."""

    values: dict[str, Any]
    fill: Callable[[], None] | None


class StoredCheckpoint:
    """A committed checkpoint at one location, its manifest read and validated once.

    ``step``, when given, must be the step the manifest names (a copy under ``step-7`` whose
    manifest says step 6 is refused with a ManifestError). Reading never changes the checkpoint.
    """

    #: What reading one copy fails with when that copy is at fault (invalid, damaged, unreadable, too
    #: large for this machine, without the items asked for): the next copy may be tried. A refusal by
    #: policy (an object that needs pickle) is not among them: every copy would be refused alike.
    COPY_ERRORS = COPY_ERRORS

    def __init__(self, location: Location, step: int | None = None, manifest: Manifest | None = None) -> None:
        self.source = as_source(location)
        self.manifest = manifest if manifest is not None else read_manifest(self.source)
        if step is not None and self.manifest.step != step:
            raise ManifestError(f"{self.source.where}: manifest is for step {self.manifest.step}, not step {step}")
        self._admitted: set[str] | None = None  # data files whose indexes were checked; None: nothing checked yet

    @classmethod
    @contextlib.contextmanager
    def locked(cls, location: Location, step: int | None = None) -> Iterator[StoredCheckpoint]:
        """The checkpoint, read under a shared lock held until the block ends, so that retention or a
        migration cannot delete it while it is being read (a directory; other sources have no lock)."""
        source = as_source(location)
        with source.reading():
            yield cls(source, step)

    # --- what it is ----------------------------------------------------------------------------
    @property
    def where(self) -> str:
        """The location, for messages: a path or a bucket prefix."""
        return self.source.where

    @property
    def directory(self) -> Path | None:
        """The local directory holding it, or None for a source that is no directory."""
        return self.source.local_directory

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def created(self) -> str:
        """When it was committed (ISO 8601, UTC), as its manifest says."""
        return self.manifest.created

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @property
    def stored_bytes(self) -> int:
        """The bytes its data files take, as the manifest records them."""
        return self.manifest.raw_bytes

    @property
    def keys(self) -> list[str]:
        """Every item's key, in the manifest's order."""
        return list(self.manifest.items)

    def providers(self) -> list[str]:
        """The providers it holds: the first part of its keys (``model`` of ``model/0.weight``)."""
        return sorted({key.split("/", 1)[0] for key in self.manifest.items if "/" in key})

    def keys_of(self, providers: Iterable[str]) -> list[str]:
        """The keys of the items of ``providers`` (by the first part of each key)."""
        wanted = set(providers)
        return [key for key in self.manifest.items if key.split("/", 1)[0] in wanted]

    def view(self, rank: int = 0, keys: Iterable[str] | None = None) -> RankView:
        """The checkpoint as ``rank`` reads it: ``keys`` (all by default) with per-rank items resolved to
        ``rank``'s value. MissingItemError names a wanted per-rank item ``rank`` has no value of."""
        wanted = self.keys if keys is None else list(keys)
        unknown = [k for k in wanted if k not in self.manifest.items]
        if unknown:
            raise MissingItemError(f"{self.where}: no item(s) {', '.join(unknown[:8])}")
        return RankView(self, rank, wanted)

    # --- reading ---------------------------------------------------------------------------------
    def read(
        self, keys: Iterable[str] | None = None, allow_pickle: bool = False, rank: int = 0, workers: int = 4
    ) -> dict[str, Any]:
        """Items (all by default): key -> tensor (CPU, a buffer of its own; a tied tensor is its target's)
        or object. Sharded tensors come back whole, per-rank items as ``rank``'s."""
        return self.view(rank, keys).read(allow_pickle=allow_pickle, workers=workers)

    def fill_live(
        self,
        live: Mapping[str, torch.Tensor],
        keys: Iterable[str] | None = None,
        allow_pickle: bool = False,
        rank: int = 0,
        workers: int = 4,
        fresh: Collection[str] = (),
    ) -> LiveRead:
        """:meth:`read`, the items with a tensor in ``live`` (by key) to be read straight into it: see
        :meth:`RankView.fill_live`."""
        return self.view(rank, keys).fill_live(live, allow_pickle=allow_pickle, workers=workers, fresh=fresh)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[Problem]:
        """Every check of tiers/reading/integrity.py on all of it: file sizes, every frame's checksum (decoded to its
        end if compressed), the indexes, the objects' encodings; nothing loaded, each bad file, frame or
        object named. Empty when intact."""
        return verify_source(self.source, self.manifest, progress)

    def admit(self, files: Iterable[str]) -> None:
        """Before a read of data files ``files``: the checks every reader makes first (tiers/reading/integrity.py,
        :func:`~tiers.reading.integrity.admit`): every data file exactly the size the manifest gives it, and the
        indexes of ``files`` not checked yet; a CorruptCheckpointError naming the first problem, before
        anything is allocated."""
        pending = set(files) - (self._admitted or set())
        if self._admitted is None or pending:
            admit(self.source, self.manifest, pending)
            self._admitted = (self._admitted or set()) | pending


class RankView:
    """One rank's view of a :class:`StoredCheckpoint`: the items it wants, per-rank ones resolved to its own."""

    def __init__(self, checkpoint: StoredCheckpoint, rank: int, keys: list[str]) -> None:
        self.checkpoint = checkpoint
        self.rank = rank
        self.keys = keys
        self._view = rank_view(checkpoint.manifest, rank, keys)

    @property
    def node_part(self) -> NodePart | None:
        """Which node's part this copy is, when it is one (it lacks other nodes' files)."""
        return self._view.node_part

    @property
    def resolved_keys(self) -> list[str]:
        """The keys of this view and the alias targets they pulled in, in the order they were resolved."""
        return list(self._view.items)

    def record(self, key: str) -> AnyRecord:
        return self._view.items[key]

    def stored_key(self, key: str) -> str:
        """The item that holds ``key``'s bytes: its alias target (a tied tensor), else ``key`` itself."""
        return stored_key(key, self._view.items[key])

    def stored_keys(self, keys: Iterable[str] | None = None) -> list[str]:
        """The stored items behind ``keys`` (all of this view's by default), each once, in order."""
        return list(dict.fromkeys(self.stored_key(k) for k in (self.keys if keys is None else keys)))

    def is_sharded(self, key: str) -> bool:
        return isinstance(self._view.items[self.stored_key(key)], ShardedRecord)

    def is_per_rank(self, key: str) -> bool:
        return isinstance(self.checkpoint.manifest.items[key], PerRankRecord)

    def tensor_record(self, key: str) -> TensorRecord | ShardedRecord | None:
        """``key``'s stored tensor record (plain or sharded), or None if it holds an object."""
        record = self._view.items[key]
        return record if isinstance(record, TensorRecord | ShardedRecord) else None

    def global_shape(self, key: str) -> tuple[int, ...]:
        record = self.tensor_record(key)
        if record is None:
            raise ValueError(f"{self.checkpoint.where}: item {key!r} is no tensor")
        return global_shape(record)

    def holds_bytes_of(self, key: str) -> bool:
        """Whether the bytes of stored item ``key`` are in this copy's files (a node's part lacks some)."""
        record = self._view.items[key]
        return not isinstance(record, ObjectRecord) or all(piece.file in self._view.files for piece in record.pieces)

    def writer_of(self, key: str) -> int | None:
        """The rank whose data file holds object ``key`` (None if not an object of one rank's file)."""
        record = self._view.items[key]
        files = {piece.file for piece in record.pieces} if isinstance(record, ObjectRecord) else set()
        return data_file_rank(next(iter(files))) if len(files) == 1 else None

    def writer(self, region: Region) -> int | None:
        """The rank that wrote all of the region's bytes (they are in its data file), or None."""
        files = source_files(region)
        return data_file_rank(next(iter(files))) if len(files) == 1 else None

    def _files_of(self, keys: Iterable[str]) -> set[str]:
        """The data files holding the stored bytes of ``keys`` (of a sharded tensor, those of all its shards)."""
        files: set[str] = set()
        for key in self.stored_keys(keys):
            record = self._view.items[key]
            parts = record.shards if isinstance(record, ShardedRecord) else [record]
            files |= {p.file for part in parts if isinstance(part, TensorRecord | ObjectRecord) for p in part.pieces}
        return files

    def read(self, keys: Iterable[str] | None = None, allow_pickle: bool = False, workers: int = 4) -> dict[str, Any]:
        """Items of this view (``keys``, all by default), every frame verified: key -> tensor or object."""
        wanted = self.keys if keys is None else list(keys)
        self.checkpoint.admit(self._files_of(wanted))
        return read_view(self.checkpoint.source, self._view, wanted, allow_pickle, workers)

    def fill_live(
        self,
        live: Mapping[str, torch.Tensor],
        keys: Iterable[str] | None = None,
        allow_pickle: bool = False,
        workers: int = 4,
        stage: bool = False,
        fresh: Collection[str] = (),
    ) -> LiveRead:
        """Items of this view (``keys``, all by default), those that have a live tensor in ``live`` of the
        stored dtype and shape left to be read straight into it by ``LiveRead.fill()``, with no buffer
        between (tiers/reading/livefill.py): the frames holding them are verified here, so a damaged copy fails
        now with nothing touched. Where every such tensor's key is in ``fresh`` (it holds nothing to protect:
        providers/fresh.py) they are filled here instead, in one pass verifying as it copies, and
        ``LiveRead.fill`` is None. Every other item is read as :meth:`read` reads it. ``stage`` fills CPU
        tensors through the staging block a GPU tensor is filled through (for tests)."""
        wanted = self.keys if keys is None else list(keys)
        self.checkpoint.admit(self._files_of(wanted))
        source = self.checkpoint.source
        records = {
            key: record for key in self.stored_keys(wanted) if isinstance(record := self._view.items[key], TensorRecord)
        }
        chosen: dict[str, torch.Tensor] = {}
        fill = None
        directory = source.local_directory
        if directory is not None:  # file descriptors, kept open from verify to fill
            chosen, frames = plan(self._view, records, live)
            fill = LiveFill(directory, self._view, chosen, frames, workers, stage) if chosen else None
        try:
            if fill is not None and set(chosen) <= set(fresh):
                fill.fill_once()
                fill = None
            elif fill is not None:
                fill.verify()
            rest = [key for key in wanted if self.stored_key(key) not in chosen]
            values = read_view(source, self._view, rest, allow_pickle, workers) if rest else {}
        except BaseException:
            if fill is not None:
                fill.close()
            raise
        # A parameter is handed over detached (the same memory): a value is data, and an optimizer that keeps
        # or clones one (state tied to a parameter) must not get a tensor that requires grad.
        live_values = {key: t.detach() if t.requires_grad else t for key, t in chosen.items()}
        state = {k: live_values[s] if (s := self.stored_key(k)) in chosen else values[k] for k in wanted}
        return LiveRead(state, None if fill is None else fill.fill)

    def read_regions(self, regions: Sequence[Region], workers: int = 4) -> RegionsRead:
        """One tensor per region (a box of a stored tensor), in one verified pass over the frames needed."""
        self.checkpoint.admit({file for region in regions for file in source_files(region)})
        return read_regions(self.checkpoint.source, self._view, regions, workers)

    def region(self, key: str, box: Box | None = None) -> Region:
        """The region of stored tensor ``key`` inside ``box`` (a :class:`~tiers.reading.boxes.Box`; whole by
        default)."""
        record = self.tensor_record(key)
        if record is None:
            raise ValueError(f"{self.checkpoint.where}: item {key!r} is no tensor")
        return Region(key, record, Box.whole(global_shape(record)) if box is None else box)

    def shard_boxes(self, key: str) -> list[Box]:
        """The boxes the shards of sharded tensor ``key`` were saved as (the layout to reshard from)."""
        record = self._view.items[key]
        if not isinstance(record, ShardedRecord):
            raise ValueError(f"{self.checkpoint.where}: item {key!r} is not sharded")
        return record.boxes()

    def item_bytes(self, records: Mapping[str, TensorRecord | ObjectRecord]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each record's stored bytes (uint8, verified), a bounded batch at a time, for exporters that
        write items one by one; sharded tensors (given as one whole record) reassembled whole."""
        self.checkpoint.admit(self._files_of(records))
        stored = [(key, record) for key, record in records.items() if not self.is_sharded(key)]
        for batch in batches(stored, self._view):
            yield from read_records(self.checkpoint.source, self._view, batch).items()
        for key in records:
            if self.is_sharded(key):
                whole = self.read([key])[key]
                yield key, whole.contiguous().reshape(-1).view(torch.uint8)


def load(path: str | os.PathLike[str], allow_pickle: bool = False) -> dict[str, Any]:
    """The plain state of one committed checkpoint directory, without a runner: key -> value."""
    with gc_paused():  # the manifest's records and the items' buffers: see tiers/format/gcpause.py
        return StoredCheckpoint(Path(path)).read(allow_pickle=allow_pickle)


class Holder(Protocol):
    """What reading the first clean copy needs of a tier, a directory or a bucket: its name, steps, a location."""

    @property
    def name(self) -> str: ...

    def steps(self) -> list[int]: ...

    def location(self, step: int) -> Location: ...


HolderT = TypeVar("HolderT", bound=Holder)
T = TypeVar("T")


def read_first_clean(
    tiers: Sequence[HolderT],
    step: int,
    read: Callable[[StoredCheckpoint], T],
    problems: list[str],
    listed: Mapping[str, Collection[int]] | None = None,
    errors: tuple[type[BaseException], ...] = COPY_ERRORS,
    label: str = "tier {tier} step {step}",
) -> tuple[HolderT, T] | None:
    """The first of ``tiers`` (in order: fastest first, the buckets last) holding ``step`` whose copy ``read``
    reads without one of ``errors`` (a copy at fault), with what it read; None if none does. Each copy is read
    locked (retention cannot delete it meanwhile), and each one passed over is added to ``problems``, named.
    ``listed``: each tier's steps by name, as the caller listed them (a bucket's listing is a request: a
    caller trying step after step lists once), else each tier is listed here. ``label`` names a copy in
    ``problems`` (``{tier}``, ``{step}``)."""
    for tier in tiers:
        if step not in (listed[tier.name] if listed is not None else tier.steps()):
            continue
        try:
            with StoredCheckpoint.locked(tier.location(step), step) as checkpoint:
                return tier, read(checkpoint)
        except errors as exc:
            problems.append(f"{label.format(tier=tier.name, step=step)}: {exc}")
    return None
