"""The ``tierstate`` commands on a bucket tier (``s3://bucket/prefix``): ls, verify, migrate, prune, gc.

Each returns the result types of :mod:`tiers.commands` (ls entries, :class:`~tiers.verify.VerifyResult`,
:class:`~tiers.migrate.MigrateReport`, retention :class:`~tiers.retention.Decision` and
:class:`~tiers.retention.Leftover`), so the command line renders a bucket's results next to a
directory tier's, and a script reading ``--json`` sees one shape. Reading goes through the read
object (:class:`~tiers.stored.StoredCheckpoint` and :func:`~tiers.integrity.verify_source` over a
:class:`~tiers.s3tier.BucketSource`): the frames of a bucket are checked by the code that checks a
directory's. Copies to and from a bucket are :mod:`tiers.transfer`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .catalog import summary
from .format import ManifestError
from .names import STEP_PREFIX, step_name
from .policy import FlushPolicy, RetentionPolicy
from .retention import Decision, Leftover
from .s3tier import S3Tier, step_of_object


@dataclass(frozen=True)
class BucketPolicies:
    """A bucket tier with the retention its YAML section (or ``--keep-last``) gives it, and its flush."""

    tier: S3Tier
    retention: RetentionPolicy = RetentionPolicy()
    flush: FlushPolicy | None = None


def _step_bytes(tier: S3Tier) -> dict[int, tuple[int, datetime]]:
    """Per step with objects under its prefix: their total size and the newest one's time."""
    found: dict[int, tuple[int, datetime]] = {}
    for obj in tier.store.list(STEP_PREFIX):
        step = step_of_object(obj.name)
        if step is not None:
            size, newest = found.get(step, (0, obj.modified))
            found[step] = (size + obj.size, max(newest, obj.modified))
    return found


# --- ls -------------------------------------------------------------------------------------------
def bucket_entries(tier: S3Tier) -> list[dict[str, Any]]:
    """``tier``'s checkpoints as ls entries, then its steps without a manifest (a writer at work or a
    killed one: no checkpoint) as ``partial`` ones with their age, as a directory's ``.partial``."""
    entries: list[dict[str, Any]] = []
    steps = tier.steps()
    for step in steps:
        try:
            entries.append({"tier": tier.name, "state": "committed", "flushed": False, **summary(tier.manifest(step))})
        except ManifestError as exc:
            entries.append({"tier": tier.name, "step": step, "state": "invalid", "error": str(exc)})
    now = datetime.now(UTC)
    for step, (size, newest) in sorted(_step_bytes(tier).items()):
        if step not in steps:
            age = round((now - newest).total_seconds(), 1)
            entry = {"tier": tier.name, "step": step_name(step), "state": "partial", "stored_bytes": size, "age_s": age}
            entries.append(entry)
    return entries


# --- prune and gc ---------------------------------------------------------------------------------
def prune_bucket(policies: BucketPolicies, dry_run: bool) -> tuple[list[Decision], dict[tuple[str, int], int]]:
    """Apply the bucket's retention (manifest first, so a step stops being a checkpoint at once); the
    decision per step and each step's bytes in the bucket."""
    tier, retention = policies.tier, policies.retention
    steps = tier.steps()
    sizes = {(tier.name, step): size for step, (size, _) in _step_bytes(tier).items() if step in steps}
    decisions = []
    for step in steps:
        reason = retention.keeps(step, steps)
        if reason is None and not dry_run:
            tier.delete_step(step)
        decisions.append(Decision(tier.name, step, reason is None, reason or f"not kept by {retention.describe()}"))
    return decisions, sizes


def bucket_garbage(tier: S3Tier, older_than: float, dry_run: bool) -> list[Leftover]:
    """:meth:`S3Tier.collect_garbage` as the gc command's leftovers."""
    found = tier.collect_garbage(older_than, dry_run=dry_run)
    return [Leftover(tier.name, f.what, f.kind, f.age_s, f.removed, "dry run" if dry_run else "removed") for f in found]
