"""A step read from the first tier whose copy reads clean: what the integrations' loaders share.

The HF callback (the newest Trainer state) and the Lightning plugin (a saved checkpoint dict) read a
checkpoint without a runner's restore, through the read object alone: each copy is read locked (so
retention cannot delete it meanwhile) and verified, and a damaged one is noted and the next tier's
copy tried, as a runner's restore does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, TypeVar

from ..tiers.stored import Location, StoredCheckpoint

T = TypeVar("T")


class Tier(Protocol):
    """What a loader needs of a tier, a directory or a bucket: its name, its steps, where one is."""

    @property
    def name(self) -> str: ...

    def steps(self) -> list[int]: ...

    def location(self, step: int) -> Location: ...


TierT = TypeVar("TierT", bound=Tier)


def read_first_clean(
    tiers: Sequence[TierT],
    step: int,
    read: Callable[[StoredCheckpoint], T],
    problems: list[str],
    listed: Mapping[str, Collection[int]] | None = None,
) -> tuple[TierT, T] | None:
    """The first of ``tiers`` (in order: the buckets last) holding ``step`` whose copy ``read`` reads
    without a copy error, with what it read; None if none does. Each copy passed over is added to
    ``problems``, named. ``listed``: each tier's steps by name, as the caller listed them (a bucket's
    listing is a request: a caller trying step after step lists once), else each tier is listed here."""
    for tier in tiers:
        if step not in (listed[tier.name] if listed is not None else tier.steps()):
            continue
        try:
            with StoredCheckpoint.locked(tier.location(step), step) as checkpoint:
                return tier, read(checkpoint)
        except StoredCheckpoint.COPY_ERRORS as exc:
            problems.append(f"tier {tier.name} step {step}: {exc}")
    return None
