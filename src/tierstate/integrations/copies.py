"""A step read from the first tier whose copy reads clean: what the integrations' loaders share.

The HF callback (the newest Trainer state) and the Lightning plugin (a saved checkpoint dict) read a
checkpoint without a runner's restore, through the read object alone: each copy is read locked (so
retention cannot delete it meanwhile) and verified, and a damaged one is noted and the next tier's
copy tried, as a runner's restore does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from tierstate import FilesystemTier

from ..tiers.stored import StoredCheckpoint

T = TypeVar("T")


def read_first_clean(
    tiers: Sequence[FilesystemTier], step: int, read: Callable[[StoredCheckpoint], T], problems: list[str]
) -> tuple[FilesystemTier, T] | None:
    """The first of ``tiers`` (in order) holding ``step`` whose copy ``read`` reads without a copy error,
    with what it read; None if none does. Each copy passed over is added to ``problems``, named."""
    for tier in tiers:
        if step not in tier.steps():
            continue
        try:
            with StoredCheckpoint.locked(tier.step_dir(step), step) as checkpoint:
                return tier, read(checkpoint)
        except StoredCheckpoint.COPY_ERRORS as exc:
            problems.append(f"tier {tier.name} step {step}: {exc}")
    return None
