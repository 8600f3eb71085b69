"""A multi-rank checkpoint split over nodes: each node's part, and the whole put back together.

On a node-scoped tier (local NVMe) every node holds only its own ranks' files, so each node's
``step-N/`` has a manifest of its own: the whole checkpoint's items, but ``files`` and ``indexes``
limited to that node's, and a :class:`~tiers.format.manifest.NodePart` naming the node, its ranks and every
node of the job. Such a manifest is not a checkpoint anyone can restore alone; it is what a node
flushes to a shared tier.

On the shared tier the parts meet in one ``step-N.partial/``: each node copies its files there
(no two nodes write the same file), then drops a marker (``node-<name>.part``, its part manifest)
and tries to publish. Whichever node finds every node's marker present publishes the global
manifest by the tier's commit (manifest last, atomic rename), under an exclusive lock so two nodes
finishing together do not both write it; since each node writes its marker before it looks, the
last one to finish always sees them all. A node that died mid-copy leaves no marker, so the
shared tier never lists a checkpoint missing a part; flushing that node's part again completes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..format.format import ManifestError, check_consistency, parse_manifest
from ..format.manifest import NODE_PART_VERSION, Manifest, NodePart
from ..format.multirank import oldest_version
from ..format.names import parse_rank_file
from .filesystem import FilesystemTier
from .locks import InUseError, exclusive
from .safeopen import read_bytes

PART_MARKER_PREFIX = "node-"
PART_MARKER_SUFFIX = ".part"
_PUBLISH_ATTEMPTS = 20  # another node holds the partial only while it copies, publishes or is collected


def part_marker(node: str) -> str:
    """The name of ``node``'s marker in a shared partial directory."""
    return f"{PART_MARKER_PREFIX}{node}{PART_MARKER_SUFFIX}"


def _rank_of(name: str) -> int:
    parsed = parse_rank_file(name)
    if parsed is None:
        raise ManifestError(f"{name!r} is not a rank's file")
    return parsed.rank


def node_part(whole: Manifest, node: str, ranks: list[int], nodes: list[str]) -> Manifest:
    """The part of ``whole`` that ``node`` (which ran ``ranks``) holds, in a job of ``nodes``."""
    return files_of_ranks(whole, ranks).model_copy(
        update={
            "version": NODE_PART_VERSION,
            "node_part": NodePart(node=node, ranks=sorted(ranks), nodes=sorted(nodes)),
        }
    )


def files_of_ranks(manifest: Manifest, ranks: list[int]) -> Manifest:
    """``manifest`` with only the data files and indexes that ``ranks`` wrote (what a rank uploads of a
    checkpoint its job committed); its items stay whole, so it is no checkpoint of its own."""
    mine = set(ranks)
    return manifest.model_copy(
        update={
            "files": {name: record for name, record in manifest.files.items() if _rank_of(name) in mine},
            "indexes": {name: digest for name, digest in manifest.indexes.items() if _rank_of(name) in mine},
        }
    )


def join_parts(step: int, parts: list[Manifest]) -> Manifest:
    """The global manifest of every node's part of ``step``; ManifestError if they do not fit together."""
    first = parts[0]
    if first.node_part is None:  # only parts are joined
        raise ManifestError(f"step {step}: a whole checkpoint's manifest among the node parts to join")
    nodes = first.node_part.nodes
    for part in parts:
        if part.node_part is None or part.node_part.nodes != nodes:
            raise ManifestError(f"step {step}: node parts disagree on the job's nodes")
        if not part.same_checkpoint(first) or part.step != step or part.items != first.items:
            raise ManifestError(
                f"step {step}: node {part.node_part.node}'s part is of another checkpoint "
                f"(id {part.checkpoint_id}, created {part.created}; not {first.checkpoint_id}, {first.created})"
            )
    if sorted(p.node_part.node for p in parts if p.node_part) != nodes:
        raise ManifestError(f"step {step}: parts of nodes {[p.node_part for p in parts]}, expected one of each {nodes}")
    ranks = sorted(r for p in parts if p.node_part for r in p.node_part.ranks)
    if ranks != list(range(first.world_size)):
        raise ManifestError(f"step {step}: the node parts hold ranks {ranks}, not 0..{first.world_size - 1}")
    files = {name: record for part in parts for name, record in part.files.items()}
    indexes = {name: digest for part in parts for name, digest in part.indexes.items()}
    whole = first.model_copy(
        update={"version": oldest_version(first.items), "files": files, "indexes": indexes, "node_part": None}
    )
    check_consistency(whole, f"step {step} joined from nodes {', '.join(nodes)}")
    return whole


def part_of_marker(data: bytes, name: str, step: int, where: str) -> Manifest:
    """The node part that marker ``name`` (read from ``where``) holds; ManifestError if it is not the part of
    step ``step`` of the node the name says."""
    part = parse_manifest(data, where)
    if part.node_part is None or part.step != step or name != part_marker(part.node_part.node):
        raise ManifestError(f"{where}: not a node part of step {step}")
    return part


def parts_present(partial: Path, step: int) -> tuple[list[Manifest], list[str]]:
    """The node parts whose markers are in ``partial``, and the nodes whose markers are not yet."""
    parts: list[Manifest] = []
    for marker in sorted(partial.glob(f"{PART_MARKER_PREFIX}*{PART_MARKER_SUFFIX}")):
        # read_bytes: never through a planted symlink or FIFO
        parts.append(part_of_marker(read_bytes(marker), marker.name, step, str(marker)))
    if not parts:
        return [], ["(every node)"]
    nodes = parts[0].node_part.nodes if parts[0].node_part else []
    present = {p.node_part.node for p in parts if p.node_part}
    return parts, [node for node in nodes if node not in present]


@dataclass
class Publication:
    """What :func:`publish_parts` found: the nodes whose parts are still missing (none: the global checkpoint
    is there), and where it was published if this call published it (None: not yet, or by another node)."""

    missing: list[str]
    published: Path | None = None


def publish_parts(target: FilesystemTier, step: int) -> Publication:
    """Publish ``step`` on ``target`` if every node's part is in its partial."""
    partial = target.partial_dir(step)
    for attempt in range(_PUBLISH_ATTEMPTS):
        if step in target.steps():
            return Publication([])
        parts, missing = parts_present(partial, step)
        if missing:
            return Publication(missing)
        try:
            with exclusive(partial):
                return Publication([], target.commit(step, join_parts(step, parts)))
        except InUseError:  # a node finishing at the same moment: it or this one publishes on the next look
            time.sleep(0.01 * (attempt + 1))
        except FileNotFoundError:  # renamed away: published by the other node meanwhile
            continue
    if step in target.steps():
        return Publication([])
    raise InUseError(f"{partial}: every node's part is there, but the directory stayed in use; flush again")
