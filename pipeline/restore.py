"""Choosing which committed copy to restore, and loading it into the providers.

Tiers are ordered fastest first, so the first tier that holds the wanted step and reads back clean
wins. A copy whose manifest is invalid or whose bytes fail their checksums is skipped (logged) in
favour of the same step on a slower tier; bad data is never handed to a provider.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierstate.errors import TierstateError

from ..providers.base import ReadState, RestoreError
from ..providers.composite import CompositeProvider
from ..providers.dtensor import storage_of
from ..tiers.reading.stored import Location, StoredCheckpoint
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.tier import Tier

log = logging.getLogger("tierstate")


class NoCheckpointError(TierstateError, FileNotFoundError):
    """No tier holds a committed, readable checkpoint for the requested step."""


class NothingToRestoreError(NoCheckpointError):
    """No tier (of any rank) holds any committed checkpoint: a first start.

    The one kind of :class:`NoCheckpointError` a trainer may take for "start from scratch"; the
    others (the step asked for is missing, every copy of it is unreadable, the ranks hold no step
    in common) mean checkpoints exist, and starting over would silently lose their progress.
    """


@dataclass(frozen=True)
class RestoreResult:
    step: int
    tier: str
    path: Path | None  # the directory read; None for a copy read from a bucket (``source`` names it)
    bytes_read: int
    seconds: float
    problems: tuple[str, ...] = ()  # the copies skipped on the way, each naming step, tier, file and frame
    tier_by_rank: tuple[str, ...] = ()  # the tier that served each rank's part, by rank (``tier`` is this rank's)
    # Rank-local providers the checkpoint, saved by fewer ranks, holds none of this rank's state of: left as they
    # were (``kept``), or given a state of their own derived from rank 0's and this rank (``derived``).
    kept: tuple[str, ...] = ()
    source: str = ""  # where this rank's copy was read: its directory, or ``s3://bucket/prefix/step-N``
    derived: tuple[str, ...] = ()


def nearest_first(tiers: list[FilesystemTier], peer_copies: list[FilesystemTier] | None = None) -> list[FilesystemTier]:
    """The order in which a rank looks for its copy of a step: this node's own tiers first (memory, then
    NVMe, as the YAML lists them), then ``peer_copies`` (this node's part as a partner node sent it
    back, pipeline/peers.py: slower than local storage, faster than the PFS), then the shared ones."""
    own = [t for t in tiers if t.scope == "node"]
    return own + list(peer_copies or []) + [t for t in tiers if t.scope != "node"]


def checked_target(which: int | str) -> int | str:
    """``which`` if it is ``"latest"`` or a step number >= 0; else a ValueError."""
    if which == "latest" or (isinstance(which, int) and not isinstance(which, bool) and which >= 0):
        return which
    raise ValueError(f"restore target must be 'latest' or a step number >= 0, got {which!r}")


def candidate_steps(held: Collection[int], which: int | str, fallback: bool) -> list[int]:
    """The steps to try, in order: ``which`` (the newest of ``held`` for "latest"), then with ``fallback``
    the older steps of ``held``, newest first. ``which`` comes first even if not held (its error names it)."""
    wanted = max(held) if checked_target(which) == "latest" else int(which)
    return [wanted] + (sorted((s for s in held if s < wanted), reverse=True) if fallback else [])


Copy = tuple[str, Location]  # a tier's name, and where its copy of a step is


def lost_entries(tiers: Sequence[Tier]) -> list[tuple[int, str]]:
    """Every ``step-N`` entry that is not a checkpoint (a lost manifest, a symlink): its step, and a text
    naming its tier and why: steps a restore cannot have."""
    return [
        (entry.step, f"step {entry.step} on tier {tier.name}: not a checkpoint: {entry}")
        for tier in tiers
        for entry in tier.invalid()
        if entry.named_as_checkpoint
    ]


def fresh_read(state: dict[str, Any], fill: Callable[[], None] | None = None) -> ReadState:
    """A state just read into buffers of its own (:meth:`StoredCheckpoint.read`), as the providers receive it: every
    tensor fresh, except those sharing storage with another item (tied weights), which a keeping
    provider must still copy, and empty ones, whose storages cannot be told apart. A live tensor
    :meth:`StoredCheckpoint.fill_live` is to ``fill`` counts as fresh too: the provider that keeps it keeps its own."""
    tensors = {key: v for key, v in state.items() if isinstance(v, torch.Tensor)}
    addresses = {key: storage_of(t) for key, t in tensors.items()}
    storages = Counter(addresses.values())
    fresh = {key for key, t in tensors.items() if t.numel() and storages[addresses[key]] == 1}
    return ReadState(state, fresh, fill)


def require_providers(
    checkpoint: StoredCheckpoint, provider: CompositeProvider, where: str, leave_out: Collection[str] = ()
) -> None:
    """Every registered provider that has state has items in the checkpoint: else a RestoreError naming the
    providers the checkpoint lacks and those it has (a renamed ``register`` name, a provider added since),
    instead of the first provider's complaint about a missing item."""
    held = sorted({key.split("/", 1)[0] for key in checkpoint.keys})
    missing = [
        name for name, child in provider.children.items()
        if name not in held and name not in leave_out and child.describe()  # one with no state has nothing to lack
    ]  # fmt: skip
    if missing:
        names = ", ".join(repr(name) for name in missing)
        raise RestoreError(
            f"{where}: the checkpoint has no provider {names} (it has: {', '.join(held) or 'nothing'}); "
            "register each under the name it was saved with"
        )


def unusable(wanted: int, fallback: bool, problems: list[str]) -> str:
    """Why no copy of ``wanted`` (nor, with ``fallback``, of an older step) could be restored."""
    detail = "; ".join(problems) if problems else "no tier holds it"
    return f"cannot restore step {wanted}{' or any older step' if fallback else ''}: {detail}"
