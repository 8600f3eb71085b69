"""What ``tierstate ls`` and ``inspect`` know about checkpoints: a manifest's summary and item rows,
and beyond the manifest, verified or damaged, flushed, and leftovers; as data (the CLI words them)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..format.manifest import Manifest
from ..format.records import AliasRecord, ObjectRecord, PerRankRecord, ShardedRecord
from ..storage.filesystem import FilesystemTier
from .due import receipts
from .retention import DELETING_SUFFIX, age_of, leftovers
from .verify import read_stamp


def summary(manifest: Manifest) -> dict[str, Any]:
    """A checkpoint in one row: step, creation time, item, byte, file and rank counts."""
    return {
        "step": manifest.step,
        "created": manifest.created,
        "items": len(manifest.items),
        "raw_bytes": manifest.raw_bytes,
        "stored_bytes": manifest.stored_bytes,
        "files": len(manifest.files),
        "ranks": manifest.world_size,
        # On a node-scoped tier, one node's part of a multi-rank checkpoint: the node and its ranks.
        "node": manifest.node_part.node if manifest.node_part else None,
        "node_ranks": manifest.node_part.ranks if manifest.node_part else None,
    }


def item_rows(manifest: Manifest) -> list[dict[str, Any]]:
    """One row per item: key, kind, dtype (or serializer, alias target, rank count), shape, bytes."""
    rows = []
    for key, record in manifest.items.items():
        if isinstance(record, AliasRecord):
            rows.append({"key": key, "kind": "alias", "type": f"= {record.of}", "shape": "", "bytes": 0})
        elif isinstance(record, ObjectRecord):
            rows.append({"key": key, "kind": "object", "type": record.serializer, "shape": "", "bytes": record.length})
        elif isinstance(record, PerRankRecord):
            held = f"{len(record.ranks)} ranks"
            rows.append({"key": key, "kind": "per-rank", "type": held, "shape": "", "bytes": manifest.item_nbytes(key)})
        elif isinstance(record, ShardedRecord):
            shape = "x".join(map(str, record.global_shape)) or "scalar"
            nbytes = manifest.item_nbytes(key)
            rows.append({"key": key, "kind": "sharded", "type": record.dtype, "shape": shape, "bytes": nbytes})
        else:
            shape = "x".join(map(str, record.shape)) or "scalar"
            rows.append(
                {"key": key, "kind": "tensor", "type": record.dtype, "shape": shape, "bytes": manifest.item_nbytes(key)}
            )
    return rows


def copy_state(tiers: Sequence[FilesystemTier], tier: FilesystemTier, step: int) -> dict[str, Any]:
    """State of a committed copy: ``verified`` or ``damaged`` as the last full verification of this very
    manifest found it (``committed`` if none ran since it was written); ``flushed`` when a slower tier
    (later in the list) also holds the step, or received it (its receipt is in this copy: a bucket, or a
    tier whose retention let it go since)."""
    stamp = read_stamp(tier.step_dir(step))
    later = tiers[[t.name for t in tiers].index(tier.name) + 1 :]
    flushed_to = [t.name for t in later if step in t.steps()]
    flushed_to += [name for name in receipts(tier, step) if name not in flushed_to]
    state = "committed" if stamp is None else "verified" if stamp.ok else "damaged"
    return {
        "state": state,
        "verified_at": stamp.at if stamp is not None and stamp.ok else None,
        "damaged_at": stamp.at if stamp is not None and not stamp.ok else None,
        "problems": list(stamp.problems) if stamp is not None else [],
        "flushed": bool(flushed_to),
        "flushed_to": flushed_to,
    }


def leftover_entries(tier: FilesystemTier) -> list[dict[str, Any]]:
    """``.partial`` (being written, or left by a crash) and ``.deleting`` directories, with their age."""
    entries = []
    for path in leftovers(tier):
        state = "deleting" if path.name.endswith(DELETING_SUFFIX) else "partial"
        try:
            with os.scandir(path) as listing:  # each entry as itself: a planted symlink is not followed
                size = sum(e.stat(follow_symlinks=False).st_size for e in listing if e.is_file(follow_symlinks=False))
            age = round(age_of(path), 1)
        except FileNotFoundError:
            continue  # finished or removed meanwhile
        entries.append({"tier": tier.name, "step": path.name, "state": state, "stored_bytes": size, "age_s": age})
    return entries


def invalid_entries(tier: FilesystemTier) -> list[dict[str, Any]]:
    """Entries named like checkpoints that are not (a lost manifest, a symlink), with the reason."""
    entries = []
    for e in tier.invalid():
        step = e.step if e.named_as_checkpoint else e.path.name
        entries.append({"tier": tier.name, "step": step, "state": "invalid", "error": str(e)})
    return entries
