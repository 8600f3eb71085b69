"""Choosing which committed copy to restore, and loading it into the providers.

Tiers are ordered fastest first, so the first tier that holds the wanted step and reads back clean
wins. A copy whose manifest is invalid or whose bytes fail their checksums is skipped (logged) in
favour of the same step on a slower tier; bad data is never handed to a provider.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from providers.composite import CompositeProvider
from tiers.filesystem import FilesystemTier
from tiers.format import ManifestError
from tiers.reader import CorruptCheckpointError, read_items

log = logging.getLogger("tierstate")


class NoCheckpointError(FileNotFoundError):
    """No tier holds a committed, readable checkpoint for the requested step."""


@dataclass(frozen=True)
class RestoreResult:
    step: int
    tier: str
    path: Path
    bytes_read: int
    seconds: float


def resolve_step(tiers: list[FilesystemTier], which: int | str) -> int:
    if which == "latest":
        steps = [s for tier in tiers for s in tier.steps()]
        if not steps:
            where = ", ".join(f"{t.name}={t.root}" for t in tiers)
            raise NoCheckpointError(f"no committed checkpoint on any tier ({where})")
        return max(steps)
    if isinstance(which, bool) or not isinstance(which, int) or which < 0:
        raise ValueError(f"restore target must be 'latest' or a step number >= 0, got {which!r}")
    return which


def restore_into(
    provider: CompositeProvider, tiers: list[FilesystemTier], which: int | str, allow_pickle: bool
) -> RestoreResult:
    """Restore ``which`` into ``provider``'s children; only their items are read."""
    step = resolve_step(tiers, which)
    problems = []
    for tier in tiers:
        if step not in tier.steps():
            continue
        started = time.perf_counter()
        try:
            manifest = tier.manifest(step)
            keys = [k for k in manifest.items if k.split("/", 1)[0] in provider.children]
            state = read_items(tier.step_dir(step), manifest, keys, allow_pickle=allow_pickle)
        except (ManifestError, CorruptCheckpointError, OSError) as exc:
            log.warning("restore step %d: copy on tier %s is unusable: %s", step, tier.name, exc)
            problems.append(f"{tier.name}: {exc}")
            continue
        provider.restore(state)
        return RestoreResult(step, tier.name, tier.step_dir(step), manifest.raw_bytes, time.perf_counter() - started)
    detail = "; ".join(problems) if problems else "no tier holds it"
    raise NoCheckpointError(f"cannot restore step {step}: {detail}")
