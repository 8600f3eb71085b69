"""Set an earlier run's checkpoints aside, so that a fresh start is the run a later resume finds.

A run started afresh on tiers that hold another run's checkpoints would otherwise mix with them:
its own steps collide with the old run's (``CheckpointExistsError``) and, after a crash before it
passes the old run's newest step, ``restore("latest")`` resumes the *old* run. Nothing is deleted:
each committed ``step-N`` directory (and each peer copy's) is renamed, atomically, into a directory
``set-aside-<label>`` (``set-aside-<label>-<peer dir>`` for a peer copy) beside it in the same tier.
No tierstate listing reads those (they are not named ``step-N``), so ``latest``, retention, flushes
and peer recalls see only the new run; their bytes still count towards a bounded tier's size (they
sit at the depth :meth:`FilesystemTier.bytes_used` counts). A person restores or removes them by
hand (``tierstate load PATH``, ``rm -r``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..storage.filesystem import FilesystemTier, fsync_dir
from ..storage.peers import peer_copies
from ..storage.safeopen import make_dir

SET_ASIDE_PREFIX = "set-aside-"


def holdings(tier: FilesystemTier) -> dict[str, list[int]]:
    """The committed steps of ``tier`` and of the peer copies it keeps, by the name of their directory."""
    found = {tier.name: tier.steps()}
    found.update({copy.name: copy.steps() for copy in peer_copies(tier)})
    return {name: steps for name, steps in found.items() if steps}


def set_aside(tier: FilesystemTier, label: str) -> list[Path]:
    """Rename every committed step of ``tier`` and of its peer copies under ``set-aside-<label>``; where
    each went. A step renamed already (by another process meanwhile) is skipped."""
    moved: list[Path] = []
    for source in [tier, *peer_copies(tier)]:
        steps = source.steps()
        if not steps:
            continue
        suffix = "" if source is tier else f"-{source.root.name}"
        target = tier.root / f"{SET_ASIDE_PREFIX}{label}{suffix}"
        make_dir(target)
        for step in steps:
            try:
                os.rename(source.step_dir(step), target / source.step_dir(step).name)
            except FileNotFoundError:
                continue
            moved.append(target / source.step_dir(step).name)
        fsync_dir(target)
        fsync_dir(source.root)
    return moved
