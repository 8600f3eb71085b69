"""Multi-rank checkpoints: merging what each rank wrote into one manifest, and one rank's view of it.

Every rank writes its own data file and index, and tells the committing rank which of its items
are replicated (any one copy will do, so exactly one rank wrote it). The merged manifest then has
one entry per logical key:

- a replicated item keeps its plain record (tensor, object or alias), as in a one-rank checkpoint;
- a tensor each rank holds a shard of becomes a ``sharded`` record of all the shards;
- any other item becomes a ``per_rank`` record, one value per rank (RNG state, per-rank counters).

A manifest that uses neither multi-rank kind keeps format version 1, so older readers still read it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from .format import ManifestError, MissingItemError, now_iso
from .manifest import MULTI_RANK_VERSION, Manifest
from .records import AliasRecord, AnyRecord, ObjectRecord, PerRankRecord, ShardedRecord, TensorRecord, stored_key


@dataclass(frozen=True)
class RankPart:
    """What one rank wrote for a checkpoint: its own manifest and which of its items are replicated."""

    rank: int
    manifest: Manifest
    replicated: frozenset[str]


def merge_parts(step: int, parts: Sequence[RankPart]) -> Manifest:
    """The global manifest of ``parts`` (one per rank, ranks 0..n-1); ManifestError says what clashes.
    The checkpoint's id is rank 0's: the merged manifest is the one every rank and node then commits."""
    ranks = sorted(part.rank for part in parts)
    if ranks != list(range(len(parts))):
        raise ManifestError(f"step {step}: parts from ranks {ranks}, expected one from each of 0..{len(parts) - 1}")
    files, indexes, stats = {}, {}, {}
    leader = next(part for part in parts if part.rank == 0)
    placed: dict[str, dict[int, str]] = defaultdict(dict)
    plain: dict[str, AnyRecord] = {}
    shards: dict[str, list[TensorRecord]] = defaultdict(list)
    own: dict[str, dict[int, TensorRecord | ObjectRecord | AliasRecord]] = defaultdict(dict)
    for part in sorted(parts, key=lambda p: p.rank):
        clash = set(files) & set(part.manifest.files)
        if clash:
            raise ManifestError(f"step {step}: rank {part.rank} wrote file {sorted(clash)[0]}, already written")
        files |= part.manifest.files
        indexes |= part.manifest.indexes
        stats |= part.manifest.stats or {}  # what each rank measured of its own part
        for key, record in part.manifest.items.items():
            if not isinstance(record, TensorRecord | ObjectRecord | AliasRecord):
                raise ManifestError(
                    f"step {step}: rank {part.rank} wrote item {key!r} as {record.kind}, "
                    "but a rank's own part holds only tensor, object and alias records"
                )
            if isinstance(record, TensorRecord) and record.shard is not None:
                placed[key][part.rank] = "sharded"
                shards[key].append(record)
            elif key not in part.replicated:
                placed[key][part.rank] = "per-rank"
                own[key][part.rank] = record
            else:
                placed[key][part.rank] = "replicated"
                if key in plain:
                    writers = [r for r, p in placed[key].items() if p == "replicated"]
                    raise ManifestError(f"step {step}: replicated item {key!r} was written by ranks {writers}")
                plain[key] = record
    _check_one_placement(step, placed)
    items: dict[str, AnyRecord] = dict(plain)
    items |= {key: PerRankRecord(ranks=values) for key, values in own.items()}
    items |= {key: _sharded(step, key, written) for key, written in shards.items()}
    return Manifest(
        version=oldest_version(items),
        step=step,
        created=now_iso(),
        checkpoint_id=leader.manifest.checkpoint_id,
        world_size=len(parts),
        files=files,
        indexes=indexes,
        items={key: items[key] for key in sorted(items)},
        stats=stats or None,
    )


def oldest_version(items: Mapping[str, AnyRecord]) -> int:
    """The oldest format version that can express ``items``: 1 unless a multi-rank kind is among them."""
    multi = any(isinstance(r, ShardedRecord | PerRankRecord) for r in items.values())
    return MULTI_RANK_VERSION if multi else 1


def _check_one_placement(step: int, placed: dict[str, dict[int, str]]) -> None:
    """A key must be placed alike on every rank that has it: a mix means the providers disagree."""
    for key, by_rank in placed.items():
        kinds = sorted(set(by_rank.values()))
        if len(kinds) > 1:
            where = ", ".join(f"{kind} on rank {next(r for r, p in by_rank.items() if p == kind)}" for kind in kinds)
            raise ManifestError(f"step {step}: item {key!r} is {where}; every rank must describe it the same way")


def _sharded(step: int, key: str, written: list[TensorRecord]) -> ShardedRecord:
    first = written[0]
    if first.shard is None:  # only records with a shard are collected as shards
        raise ManifestError(f"step {step}: sharded item {key!r}: a shard without its place in the global tensor")
    try:
        return ShardedRecord(
            dtype=first.dtype,
            global_shape=first.shard.global_shape,
            shards=sorted(written, key=lambda r: r.shard.offsets if r.shard else []),
        )
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ManifestError(f"step {step}: sharded item {key!r}: {reason}") from None


def rank_record(manifest: Manifest, key: str, rank: int) -> AnyRecord:
    """The record of ``key`` as ``rank`` sees it: for a per-rank item, that rank's own value."""
    record = manifest.items[key]
    if not isinstance(record, PerRankRecord):
        return record
    if rank not in record.ranks:
        holders = sorted(record.ranks)
        raise MissingItemError(f"item {key!r} was saved per rank by rank(s) {holders}; rank {rank} has no value of it")
    return record.ranks[rank]


def rank_view(manifest: Manifest, rank: int, keys: Iterable[str]) -> Manifest:
    """The manifest as ``rank`` reads it: ``keys`` (and what their aliases name) without per-rank records.

    MissingItemError names a wanted per-rank item this rank has no value of (e.g. loading 2 ranks' RNG on 3).
    """
    items: dict[str, AnyRecord] = {}
    pending = list(keys)
    while pending:
        key = pending.pop()
        if key not in items:
            items[key] = rank_record(manifest, key, rank)
            pending.append(stored_key(key, items[key]))
    return manifest.model_copy(update={"items": items})
