"""Retention: deleting checkpoints a tier no longer keeps, and the leftovers of crashes.

A step is deleted from a tier only if all of these hold:

- the tier's :class:`~tiers.policy.RetentionPolicy` does not keep it;
- it is not the newest committed step on any tier (whatever the policy, the latest progress stays);
- it is not the last copy of a checkpoint some tier is still due to receive: a step another tier's
  flush policy selects and that tier has not received (its flush is pending, running or failed)
  stays where it is. A tier that received a copy and later let it go (its own retention pruned
  it) is no longer due: each copy published on another tier by a flush or a migration is noted
  in the source copy's directory (a ``received-TIER.json`` receipt, which goes with that copy).
  Nor is a tier whose flush of that copy can never succeed because the copy itself is damaged
  (an ``unflushable-TIER.json`` note, written once the damage is confirmed by a verification):
  the failure is reported once, and the copy goes by its tier's rule instead of being pinned forever;
- nobody is reading it (restore, migrate, flush, verify, export hold a shared lock; see
  :mod:`tiers.locks`).

A checkpoint that no tier is due to receive and no policy keeps is deleted even from its last
tier: otherwise retention on a single tier, or on NVMe checkpoints the PFS skips, could never
delete anything.

Deletion is crash safe: under an exclusive lock the directory is first unpublished by a rename to
``step-N.deleting`` (fsync'd, so it is no longer listed or restorable), then removed. A crash in
between leaves a ``.deleting`` directory, which :func:`collect_garbage` removes, as it removes
``.partial`` directories older than a bound (a crashed write or an abandoned migration). A live
writer's partial is locked by its writer (see :mod:`tiers.locks`), and garbage collection keeps it.

Garbage collection never removes what tierstate did not leave: a ``step-N`` directory without a
valid manifest (no crash leaves one, so its checkpoint was lost; the directory is the evidence, and
may hold data worth saving) or a symlink named like a checkpoint. It reports each as ``invalid,
kept``, for a person to look at and remove by hand; none is ever followed.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from . import faults
from .filesystem import DELETING_SUFFIX, PARTIAL_SUFFIX, FilesystemTier, InvalidEntry, fsync_dir
from .format import now_iso
from .locks import InUseError, exclusive
from .policy import FlushPolicy, RetentionPolicy
from .safeopen import remove, write_durably

RECEIPT_PREFIX = "received-"
UNFLUSHABLE_PREFIX = "unflushable-"


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


def delete_step(tier: FilesystemTier, step: int) -> None:
    """Unpublish, then remove, one committed checkpoint; InUseError if anyone holds it."""
    path = tier.step_dir(step)
    with exclusive(path):
        doomed = tier.root / f"{path.name}{DELETING_SUFFIX}"
        remove(doomed)  # left by an earlier crash in the middle of deleting this step (or planted: not followed)
        os.rename(path, doomed)
        fsync_dir(tier.root)
        faults.point("prune.delete", doomed)
        shutil.rmtree(doomed)


def _receipt(directory: Path, receiver: str, prefix: str = RECEIPT_PREFIX) -> Path:
    return directory / f"{prefix}{receiver}.json"


def record_receipt(source: FilesystemTier, step: int, receiver: str) -> None:
    """Note in ``source``'s copy of ``step`` that tier ``receiver`` holds it now (published there).

    The note lives and dies with that copy, and says which checkpoint was received, not which step
    number: a step number that a rolled-back run commits again is a new copy without receipts.
    """
    body = {"tier": receiver, "received_at": now_iso()}
    write_durably(_receipt(source.step_dir(step), receiver), json.dumps(body).encode())


def record_unflushable(source: FilesystemTier, step: int, receiver: str, problem: str) -> None:
    """Note in ``source``'s copy of ``step`` that it can never be flushed to ``receiver``: the copy is
    damaged (``problem`` says where). Retention then no longer pins it for ``receiver``, and nobody
    tries the flush again; like a receipt, the note goes with the copy."""
    body = {"tier": receiver, "given_up_at": now_iso(), "problem": problem}
    write_durably(_receipt(source.step_dir(step), receiver, UNFLUSHABLE_PREFIX), json.dumps(body).encode())


def _received(holders: Sequence[FilesystemTier], step: int, receiver: str) -> bool:
    """Whether tier ``receiver`` has received ``step`` from a copy one of ``holders`` still holds, or
    that copy is noted as one it can never receive (damaged)."""
    return any(
        _receipt(tier.step_dir(step), receiver, prefix).is_file()
        for tier in holders
        for prefix in (RECEIPT_PREFIX, UNFLUSHABLE_PREFIX)
    )


def due_on(
    policies: TierPolicies, step: int, everyone: Sequence[TierPolicies], holdings: Mapping[str, set[int]]
) -> list[str]:
    """The tiers other than ``policies``' own whose flush policy selects ``step`` and that have not
    received it (nor been given it up as unflushable); ``holdings``: every tier's committed steps."""
    holders = [p.tier for p in everyone if step in holdings[p.tier.name]]
    return [
        other.tier.name
        for other in everyone
        if other is not policies
        and other.flush
        and other.flush.due(step)
        and step not in holdings[other.tier.name]
        and not _received(holders, step, other.tier.name)
    ]


def _hold_reason(
    policies: TierPolicies,
    step: int,
    steps: list[int],
    newest: int,
    everyone: Sequence[TierPolicies],
    holdings: dict[str, set[int]],
) -> str | None:
    kept = policies.retention.keeps(step, steps)
    if kept:
        return kept
    if step == newest:
        return "the newest checkpoint"
    due = due_on(policies, step, everyone, holdings)
    if due:
        return f"last copy: due on {', '.join(due)} and not flushed there yet"
    return None


def prune(tiers: Sequence[TierPolicies], dry_run: bool = False, only: Collection[str] | None = None) -> list[Decision]:
    """Apply each tier's retention policy (on the tiers named in ``only``, default all)."""
    holdings = {p.tier.name: set(p.tier.steps()) for p in tiers}
    newest = max((s for held in holdings.values() for s in held), default=-1)
    decisions: list[Decision] = []
    for policies in tiers:
        name = policies.tier.name
        if (only is not None and name not in only) or not policies.retention.active:
            continue
        steps = sorted(holdings[name])
        for step in steps:
            reason = _hold_reason(policies, step, steps, newest, tiers, holdings)
            if reason is None and not dry_run:
                try:
                    delete_step(policies.tier, step)
                except InUseError:
                    reason = "in use (being read, flushed or restored)"
                except FileNotFoundError:
                    reason = "already gone (deleted by someone else)"
                except OSError as exc:  # a read-only or failing tier: the others are still pruned
                    reason = f"cannot delete: {exc.strerror or exc}"
            if reason is None:
                holdings[name].discard(step)
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
