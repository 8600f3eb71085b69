"""What ``tierstate ls`` says about each checkpoint beyond its manifest: verified, flushed, leftovers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .filesystem import FilesystemTier
from .retention import DELETING_SUFFIX, age_of, leftovers
from .verify import read_stamp


def copy_state(tiers: Sequence[FilesystemTier], tier: FilesystemTier, step: int) -> dict[str, Any]:
    """State of a committed copy: ``verified`` once a full verification passed on this very manifest,
    ``flushed`` when a slower tier (later in the list) also holds the step."""
    verified_at = read_stamp(tier.step_dir(step))
    later = tiers[[t.name for t in tiers].index(tier.name) + 1 :]
    flushed_to = [t.name for t in later if step in t.steps()]
    return {
        "state": "verified" if verified_at else "committed",
        "verified_at": verified_at,
        "flushed": bool(flushed_to),
        "flushed_to": flushed_to,
    }


def leftover_entries(tier: FilesystemTier) -> list[dict[str, Any]]:
    """``.partial`` (being written, or left by a crash) and ``.deleting`` directories, with their age."""
    entries = []
    for path in leftovers(tier):
        state = "deleting" if path.name.endswith(DELETING_SUFFIX) else "partial"
        try:
            size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
            age = round(age_of(path), 1)
        except FileNotFoundError:
            continue  # finished or removed meanwhile
        entries.append({"tier": tier.name, "step": path.name, "state": state, "stored_bytes": size, "age_s": age})
    return entries


def state_text(entry: dict[str, Any]) -> str:
    """The state column of the ls table: e.g. ``verified, flushed`` or ``partial (5 min old)``."""
    if entry["state"] in ("partial", "deleting"):
        return f"{entry['state']} ({_age(entry['age_s'])} old)"
    return entry["state"] + (", flushed" if entry.get("flushed") else "")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
