"""Retention: deleting checkpoints a tier no longer keeps, and the leftovers of crashes.

A step is deleted from a tier only if all of these hold:

- the tier's :class:`~tiers.ops.policy.RetentionPolicy` does not keep it;
- it is not the newest committed step on any tier (whatever the policy, the latest progress stays);
- it is not the copy that feeds a tier the checkpoint is still due on (tiers/ops/due.py: a tier
  downstream in the flush graph whose flush selects the step and that has not received it; its
  flush is pending, running or failed). A tier that received the checkpoint and later let it go
  (its own retention pruned it) is no longer due: its receipt (``received-TIER.json``) is in every
  copy. Nor is a tier whose flush of that copy can never succeed because the copy itself is
  damaged (an ``unflushable-TIER.json`` note, written once the damage is confirmed by a
  verification): the failure is reported once, and the copy goes by its tier's rule instead of
  being pinned forever;
- nobody is reading it (restore, migrate, flush, verify, export hold a shared lock; see
  :mod:`tiers.storage.locks`).

A checkpoint that no tier is due to receive and no policy keeps is deleted even from its last
tier: otherwise retention on a single tier, or on NVMe checkpoints the PFS skips, could never
delete anything.

Deletion is crash safe: under an exclusive lock the directory is first unpublished by a rename to
``step-N.deleting`` (fsync'd, so it is no longer listed or restorable), then removed. A crash in
between leaves a ``.deleting`` directory, which :func:`collect_garbage` removes, as it removes
``.partial`` directories older than a bound (a crashed write or an abandoned migration). A live
writer's partial is locked by its writer (see :mod:`tiers.storage.locks`), and garbage collection keeps it.

Garbage collection never removes what tierstate did not leave: a ``step-N`` directory without a
valid manifest (no crash leaves one, so its checkpoint was lost; the directory is the evidence, and
may hold data worth saving) or a symlink named like a checkpoint. It reports each as ``invalid,
kept``, for a person to look at and remove by hand; none is ever followed.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..storage.filesystem import DELETING_SUFFIX, PARTIAL_SUFFIX, FilesystemTier, InvalidEntry
from ..storage.locks import InUseError, exclusive
from ..storage.s3tier import S3Tier
from .due import StepCopies, copies_of, fed_by, holdings
from .policy import FlushGraph, FlushPolicy, RetentionPolicy


@dataclass(frozen=True)
class TierPolicies:
    """A tier with the policies its YAML section gives it."""

    tier: FilesystemTier
    retention: RetentionPolicy = RetentionPolicy()
    flush: FlushPolicy | None = None


@dataclass(frozen=True)
class Decision:
    """What retention did (or, in a dry run, would do) with one step on one tier, and why."""

    tier: str
    step: int
    delete: bool
    reason: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class BucketPolicies:
    """A bucket tier with the retention its YAML section (or ``--keep-last``) gives it, and its flush."""

    tier: S3Tier
    retention: RetentionPolicy = RetentionPolicy()
    flush: FlushPolicy | None = None


def prune_bucket(policies: BucketPolicies, dry_run: bool) -> tuple[list[Decision], dict[tuple[str, int], int]]:
    """Apply the bucket's retention (manifest first, so a step stops being a checkpoint at once); the
    decision per step and each step's bytes in the bucket."""
    tier, retention = policies.tier, policies.retention
    steps = tier.steps()
    sizes = {(tier.name, step): size for step, (size, _) in tier.step_bytes().items() if step in steps}
    decisions = []
    for step in steps:
        reason = retention.keeps(step, steps)
        if reason is None and not dry_run:
            tier.delete_step(step)
        decisions.append(Decision(tier.name, step, reason is None, reason or f"not kept by {retention.describe()}"))
    return decisions, sizes


def graph_of(tiers: Sequence[TierPolicies], buckets: Sequence[tuple[str, FlushPolicy | None]] = ()) -> FlushGraph:
    """The flush graph of ``tiers`` (fastest first) and of the buckets' ``(name, flush)``; a flush policy
    without ``from`` (built by hand: the config loader names every source) flushes from the first tier."""
    default = tiers[0].tier.name if tiers else None
    return FlushGraph.of([*((p.tier.name, p.flush) for p in tiers), *buckets], default)


def _hold_reason(
    policies: TierPolicies, step: int, steps: list[int], newest: int, graph: FlushGraph, copies: StepCopies
) -> str | None:
    kept = policies.retention.keeps(step, steps)
    if kept:
        return kept
    if step == newest:
        return "the newest checkpoint"
    due = fed_by(graph, policies.tier.name, copies)
    if due:
        return f"last copy: due on {', '.join(due)} and not flushed there yet"
    return None


def prune(
    tiers: Sequence[TierPolicies],
    dry_run: bool = False,
    only: Collection[str] | None = None,
    graph: FlushGraph | None = None,
) -> list[Decision]:
    """Apply each tier's retention policy (on the tiers named in ``only``, default all); ``graph``: what
    is due where (tiers/ops/due.py), by default that of ``tiers`` alone."""
    graph = graph_of(tiers) if graph is None else graph
    dirs = [p.tier for p in tiers]
    held = holdings(dirs)
    newest = max((s for steps in held.values() for s in steps), default=-1)
    decisions: list[Decision] = []
    for policies in tiers:
        name = policies.tier.name
        if (only is not None and name not in only) or not policies.retention.active:
            continue
        steps = sorted(held[name])
        for step in steps:
            reason = _hold_reason(policies, step, steps, newest, graph, copies_of(step, dirs, held))
            if reason is None and not dry_run:
                try:
                    policies.tier.delete_step(step)
                except InUseError:
                    reason = "in use (being read, flushed or restored)"
                except FileNotFoundError:
                    reason = "already gone (deleted by someone else)"
                except OSError as exc:  # a read-only or failing tier: the others are still pruned
                    reason = f"cannot delete: {exc.strerror or exc}"
            if reason is None:
                held[name].discard(step)
            decisions.append(
                Decision(name, step, reason is None, reason or f"not kept by {policies.retention.describe()}")
            )
    return decisions


@dataclass(frozen=True)
class Leftover:
    """A ``.partial`` or ``.deleting`` directory, or an invalid entry (kind ``invalid``: always kept),
    and what garbage collection did with it."""

    tier: str
    path: Path | str  # a directory, or for a bucket the s3:// URL of an object or upload
    kind: str
    age_s: float
    removed: bool
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "path": str(self.path), "age_s": round(self.age_s, 1)}


def leftovers(tier: FilesystemTier) -> list[Path]:
    """Directories of ``tier`` that are not (or no longer) checkpoints: partial writes, half deletions.

    Only real directories: a symlink under such a name is not tierstate's (see :meth:`FilesystemTier.invalid`).
    """
    suffixes = (PARTIAL_SUFFIX, DELETING_SUFFIX)
    found = [e for e in tier.entries() if e.name.endswith(suffixes) and e.is_dir(follow_symlinks=False)]
    return sorted(Path(e.path) for e in found)


def age_of(path: Path, now: float | None = None) -> float:
    """Seconds since anything in ``path`` (itself, or a file in it if it is a real directory) last changed."""
    itself = path.lstat()
    newest = itself.st_mtime
    if stat.S_ISDIR(itself.st_mode):
        with os.scandir(path) as listing:
            for entry in listing:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return (time.time() if now is None else now) - newest


def collect_garbage(tiers: Sequence[FilesystemTier], older_than: float, dry_run: bool = False) -> list[Leftover]:
    """Remove ``.deleting`` leftovers, and ``.partial`` ones untouched for ``older_than`` seconds.

    A leftover someone holds locked (a live runner's partial, a migration in progress) is kept,
    whatever its age. Tiers change while this runs (a trainer commits, a deletion finishes): a
    leftover that is gone by the time it is looked at is skipped, and one that cannot be removed
    is reported with the reason; neither is raised. Invalid entries (a ``step-N`` that lost its
    manifest, a symlink named like a checkpoint) are reported as kept, never removed.
    """
    found: list[Leftover] = []
    for tier in tiers:
        for path in leftovers(tier):
            outcome = _collect(tier, path, older_than, dry_run)
            if outcome is not None:
                found.append(outcome)
        found += [_kept(tier, entry) for entry in tier.invalid()]
    return found


def _kept(tier: FilesystemTier, entry: InvalidEntry) -> Leftover:
    """An invalid entry, reported and left as it is: a lost checkpoint's directory is the evidence of
    what went wrong (and may hold data worth saving by hand), a symlink is not tierstate's."""
    try:
        age = age_of(entry.path)
    except OSError:
        age = 0.0
    reason = f"invalid, kept: {entry}; gc removes only what tierstate left (look at it, then remove it by hand)"
    return Leftover(tier.name, entry.path, "invalid", age, False, reason)


def _collect(tier: FilesystemTier, path: Path, older_than: float, dry_run: bool) -> Leftover | None:
    """Remove one leftover if it is due and nobody holds it; None if it disappeared meanwhile."""
    kind = "deleting" if path.name.endswith(DELETING_SUFFIX) else "partial"
    try:
        age = age_of(path)
    except FileNotFoundError:
        return None  # removed meanwhile by whoever owned it
    except OSError as exc:
        return Leftover(tier.name, path, kind, 0.0, False, f"cannot inspect: {exc}")
    if kind == "partial" and age < older_than:
        return Leftover(tier.name, path, kind, age, False, f"younger than {older_than:g} s")
    try:
        with exclusive(path):  # verified to still be this leftover, not what a commit renamed it to
            if not dry_run:
                shutil.rmtree(path)
    except InUseError:
        return Leftover(tier.name, path, kind, age, False, "in use")
    except FileNotFoundError:
        return None  # committed (renamed) or removed by its owner meanwhile
    except OSError as exc:
        return Leftover(tier.name, path, kind, age, False, f"cannot remove: {exc}")
    return Leftover(tier.name, path, kind, age, not dry_run, "dry run" if dry_run else "removed")
