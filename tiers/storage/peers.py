"""Peer copies on disk: where a partner node keeps another node's part, and receiving one safely.

With ``replicas: 1`` on a node-scoped tier, each node's part of a checkpoint is also kept by its
partner, the next node in the sorted list of the job's nodes (a ring: the last node's partner is
the first). The partner keeps it in ``<its tier root>/peer-<node>/``, a tier directory like any
other: ``step-N/`` with the part's manifest, data files and indexes. When a node comes back without
its own copy (it was replaced), its partner sends the copy back; that lands in ``<tier root>/
from-peer-<partner>/`` on the node, which restores from it.

Whatever arrives is checked as if a stranger sent it: file names must be a manifest or a rank's
file (nothing else, so no path leaves the directory), files are created with ``O_EXCL`` and never
through a symlink, every frame and index is verified against the manifest before the copy is
published, and the manifest is written last by the tier's own commit (atomic rename).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..format.format import ManifestError, parse_manifest
from ..format.manifest import MANIFEST_NAME
from ..format.names import parse_rank_file
from ..ops.verify import write_stamp
from ..reading.integrity import verify_source
from ..reading.pieces import CorruptCheckpointError
from .filesystem import FilesystemTier
from .safeopen import check_regular, create_new, open_read

PEER_PREFIX = "peer-"
RETURNED_PREFIX = "from-peer-"


def partner_of(nodes: Sequence[str], node: str) -> str:
    """The node that keeps ``node``'s peer copy: the next one in sorted order, around the ring."""
    ordered = sorted(nodes)
    return ordered[(ordered.index(node) + 1) % len(ordered)]


def kept_for(tier: FilesystemTier, node: str) -> FilesystemTier:
    """Where ``tier`` on this node keeps ``node``'s peer copies."""
    return FilesystemTier(f"{tier.name} (copy of {node})", tier.root / f"{PEER_PREFIX}{node}", "node", nested=True)


def returned_from(tier: FilesystemTier, partner: str) -> FilesystemTier:
    """Where ``tier`` on this node holds its own part as ``partner`` sent it back (a replaced node)."""
    root = tier.root / f"{RETURNED_PREFIX}{partner}"
    return FilesystemTier(f"{tier.name} (peer {partner})", root, "node", nested=True)


def peer_copies(tier: FilesystemTier) -> list[FilesystemTier]:
    """The peer copies ``tier``'s directory holds, each as a tier of its own: other nodes' parts it keeps
    (``peer-<node>/``) and its own part sent back (``from-peer-<node>/``). Real directories only: an entry
    of that name that is a symlink is never followed."""
    found = []
    for entry in sorted(tier.entries(), key=lambda e: e.name):
        if not entry.is_dir(follow_symlinks=False):
            continue
        if entry.name.startswith(RETURNED_PREFIX) and len(entry.name) > len(RETURNED_PREFIX):
            found.append(returned_from(tier, entry.name.removeprefix(RETURNED_PREFIX)))
        elif entry.name.startswith(PEER_PREFIX) and len(entry.name) > len(PEER_PREFIX):
            found.append(kept_for(tier, entry.name.removeprefix(PEER_PREFIX)))
    return found


def part_files(tier: FilesystemTier, step: int) -> list[tuple[str, int]]:
    """The files of ``tier``'s copy of ``step`` to send, with their sizes: data, indexes, the manifest last."""
    manifest = tier.manifest(step)
    names = [*sorted(manifest.files), *sorted(manifest.indexes), MANIFEST_NAME]
    directory = tier.step_dir(step)
    return [(name, check_regular(directory / name).st_size) for name in names]


def open_part_file(tier: FilesystemTier, step: int, name: str) -> int:
    """A file of ``tier``'s copy of ``step``, opened for reading (never through a symlink)."""
    return open_read(tier.step_dir(step) / checked_name(name))


def checked_name(name: str) -> str:
    """``name`` if a checkpoint directory may hold it (a manifest, a rank's file); else a ManifestError."""
    if name != MANIFEST_NAME and parse_rank_file(name) is None:
        raise ManifestError(f"{name!r} is not a file of a checkpoint's part")
    return name


class ReceivedPart:
    """One step of a node's part arriving on ``tier``: files go into its partial directory, the manifest is
    held back, and :meth:`publish` verifies everything against it before the tier's commit publishes it."""

    def __init__(self, tier: FilesystemTier, step: int, node: str) -> None:
        self.tier, self.step, self.node = tier, step, node
        if step in tier.steps():
            tier.delete_step(step)  # an older copy of the same step number: the new one replaces it
        self.partial = tier.begin(step)
        self.manifest = b""

    def open(self, name: str) -> int | None:
        """A new file for ``name`` (None for the manifest, which is collected in memory)."""
        if checked_name(name) == MANIFEST_NAME:
            return None
        return create_new(self.partial / name)

    def publish(self) -> Path:
        """Verify the files against the manifest received, then commit; CorruptCheckpointError if they differ."""
        manifest = parse_manifest(self.manifest, f"{self.node}'s part of step {self.step}")
        if manifest.step != self.step or manifest.node_part is None or manifest.node_part.node != self.node:
            raise ManifestError(f"{self.partial}: the manifest received is not {self.node}'s part of step {self.step}")
        present = sorted(os.listdir(self.partial))
        expected = sorted([*manifest.files, *manifest.indexes])
        if present != expected:
            raise CorruptCheckpointError(f"{self.partial}: received {present}, the manifest names {expected}")
        problems = verify_source(self.partial, manifest)
        if problems:
            raise CorruptCheckpointError(f"{self.partial}: {'; '.join(str(p) for p in problems)}")
        final = self.tier.commit(self.step, manifest)
        self.tier.release()
        write_stamp(final)
        return final

    def abort(self) -> None:
        self.tier.abort(self.step)
        self.tier.release()
