"""How a job's files become a checkpoint: straight on one tier, or by a vote of every rank.

A job writes its data file and index into the partial directory either way; what differs is who
creates that directory, which items this rank writes, and what makes the checkpoint exist. One
process commits alone (:class:`TierCommit`); many ranks run a two-phase commit
(:class:`pipeline.distributed.DistributedCommit`). Every method blocks; the job runs them in its
I/O pool, never on the trainer's thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..tiers.format.format import ManifestBody
from ..tiers.storage.filesystem import FilesystemTier
from .plan import CheckpointPlan


class Commit(Protocol):
    def decline(self, reason: Exception, /) -> bool:
        """This rank cannot take part in the step (its plan failed): True if it still opens the step, to
        give it up with every other rank (which then raises ``reason``), False if the job just fails."""
        ...

    def begin(self, step: int, plan: CheckpointPlan) -> tuple[Path, CheckpointPlan]:
        """Open the partial directory; returns it and the part of ``plan`` this rank writes."""
        ...

    def commit(self, step: int, manifest: ManifestBody) -> Path:
        """Make this rank's fsynced files (described by ``manifest``, in JSON form) part of a committed
        checkpoint."""
        ...

    def abort(self, step: int, error: BaseException, /) -> None:
        """Give up ``step`` after ``error``; committed checkpoints stay as they were. Never raises.

        Positional-only, so that an implementation that has no use for ``error`` may name it ``_error``."""
        ...


class TierCommit:
    """One process: the whole plan is written here and committed by the tier's own protocol."""

    def __init__(self, tier: FilesystemTier) -> None:
        self.tier = tier

    def decline(self, _reason: Exception) -> bool:
        return False  # no one else to tell: nothing is opened

    def begin(self, step: int, plan: CheckpointPlan) -> tuple[Path, CheckpointPlan]:
        return self.tier.begin(step), plan

    def commit(self, step: int, manifest: ManifestBody) -> Path:
        return self.tier.commit(step, manifest)

    def abort(self, step: int, _error: BaseException) -> None:
        self.tier.abort(step)  # one process has no one to tell why
