"""What ``ls`` and ``gc`` say of a bucket tier (``s3://bucket/prefix``), in the shapes they say it of a directory.

Everything else the commands do to a bucket goes through the one tier interface (tiers/storage/tier.py):
verify and inspect read it through the read object, migrate copies through :mod:`tiers.ops.transfer`,
prune applies :func:`tiers.ops.retention.prune_bucket`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ..tiers.format.format import ManifestError
from ..tiers.format.names import step_name
from ..tiers.ops.catalog import summary
from ..tiers.ops.retention import Leftover
from ..tiers.storage.s3tier import S3Tier


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
    for step, (size, newest) in sorted(tier.step_bytes().items()):
        if step not in steps:
            age = round((now - newest).total_seconds(), 1)
            entry = {"tier": tier.name, "step": step_name(step), "state": "partial", "stored_bytes": size, "age_s": age}
            entries.append(entry)
    return entries


# --- prune and gc ---------------------------------------------------------------------------------
def bucket_garbage(tier: S3Tier, older_than: float, dry_run: bool) -> list[Leftover]:
    """:meth:`S3Tier.collect_garbage` as the gc command's leftovers."""
    found = tier.collect_garbage(older_than, dry_run=dry_run)
    return [Leftover(tier.name, f.what, f.kind, f.age_s, f.removed, "dry run" if dry_run else "removed") for f in found]
