"""Tier directories checked when the runner is built, so a bad path fails before training starts.

Without this, a tier path that is a file, cannot be created or is read-only shows up at the first
checkpoint (or the first flush), possibly hours into a run, as a log line. The rule, for each tier
the runner writes (the persist tier, a tier with ``flush``, a tier whose ``retention`` deletes):

* an existing directory must take a new file (tried for real: permission bits do not stop root, a
  read-only mount does);
* a missing directory is created, with its missing parents (``./checkpoints/nvme`` on a fresh
  machine, ``/scratch/me/run7/nvme``), when the nearest existing one is a writable directory; but
  never at the top of the file system: ``/lustre/run7`` with ``/lustre`` absent is an unmounted
  file system or a typo, and creating it would put the checkpoints on the wrong disk;
* a path that is a file, or under one, is an error;
* a path in another user's hands (tiers/storage/ownership.py: a symlink they own, a tier directory they
  own, a world-writable directory without the sticky bit) is refused, as ssh's StrictModes does;
* a memory tier whose ``size`` its file system cannot give it (Docker's 64 MB ``/dev/shm`` under a
  ``size: 8GiB``) is refused, naming the key, the bytes and the fix (tiers/storage/slotdirs.py).

A tier the runner only reads (restore from a read-only archive) need not be writable nor exist,
but must not be a file. Every error is a :class:`TierError` naming the tier and the path.

A tier that receives checkpoints (the persist tier, a flush target, a bucket) and has no ``retention``
keeps every one of them: its disk fills as training goes on (a checkpoint every 2 steps wrote 8.7 GB
in 12 s). That is allowed (an archive keeps everything on purpose) but said, once per runner, naming the
key to set (:func:`warn_unbounded`).
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path

from ..tiers.storage.filesystem import FilesystemTier, TierError
from ..tiers.storage.ownership import ownership_problem
from ..tiers.storage.slotdirs import room_problem
from .config import PipelineConfig

log = logging.getLogger("tierstate")


def written_tiers(config: PipelineConfig) -> set[str]:
    """The tiers this runner's checkpoints, flushes or retention write to."""
    written = {config.persist_tier}
    written |= {name for name, tier in config.tiers.items() if tier.flush is not None or tier.retention.active}
    return written


def warn_unbounded(config: PipelineConfig) -> None:
    """A warning on the ``tierstate`` logger for each tier that receives checkpoints and keeps them all."""
    receiving = {config.persist_tier} | {name for name, tier in config.tiers.items() if tier.flush is not None}
    unbounded = [name for name in config.tiers if name in receiving and not config.tiers[name].retention.active]
    unbounded += [
        name for name, bucket in config.buckets.items()
        if (bucket.flush is not None or name == config.persist_bucket) and not bucket.retention.active
    ]  # fmt: skip
    for name in unbounded:
        log.warning(
            "tiers.%s has no retention: it keeps every checkpoint, so its storage fills as training goes on; "
            "set tiers.%s.retention (e.g. {keep_last: 3}) to keep the newest only",
            name, name,
        )  # fmt: skip


def check_tier_paths(config: PipelineConfig) -> None:
    """Create what is missing and refuse what cannot work, by the rule of the module docstring."""
    written = written_tiers(config)
    for name, tier in config.tiers.items():
        problem = ownership_problem(tier.path)
        if problem is not None:
            raise _error(errno.EPERM, name, tier.path, f"is refused: {problem} (see README, Guarantees)")
        if name in written:
            _writable_directory(name, tier.path)
            if tier.kind == "memory" and tier.size is not None:
                _room_for_memory_tier(name, tier.path, int(tier.size))
        elif tier.path.exists() and not tier.path.is_dir():
            raise _error(errno.ENOTDIR, name, tier.path, "is not a directory")


def _room_for_memory_tier(name: str, path: Path, size: int) -> None:
    """A memory tier's ``size`` must fit in its file system (less what others hold there), or a checkpoint into
    it would find no room, however retention frees its own: refused now, not at the first checkpoint."""
    problem = room_problem(name, path, size, FilesystemTier(name, path).bytes_used())
    if problem is not None:
        raise TierError(errno.ENOSPC, f"tier {name}: {problem}")


def _writable_directory(name: str, path: Path) -> None:
    if not path.is_dir():
        if path.exists() and not path.is_dir():  # checked twice: another rank may create it meanwhile
            raise _error(errno.ENOTDIR, name, path, "is not a directory")
        existing = next(p for p in path.parents if p.exists())
        if not existing.is_dir():
            raise _error(errno.ENOTDIR, name, path, f"is not a directory (under {existing}, which is a file)")
        if existing == Path(existing.anchor):
            top = path.relative_to(existing).parts[0]
            raise _error(errno.ENOENT, name, path, f"cannot be created: {existing}{top} does not exist")
        try:
            path.mkdir(parents=True, exist_ok=True)  # exist_ok: another rank may create it meanwhile
        except FileExistsError as exc:  # a file created meanwhile
            raise _error(errno.ENOTDIR, name, path, "is not a directory") from exc
        except OSError as exc:
            raise _error(exc.errno, name, path, f"cannot be created: {exc.strerror or exc}") from exc
    try:
        handle, probe = tempfile.mkstemp(prefix=".tierstate-probe-", dir=path)
    except OSError as exc:
        raise _error(exc.errno, name, path, f"is not writable: {exc.strerror or exc}") from exc
    os.close(handle)
    os.unlink(probe)


def _error(code: int | None, name: str, path: Path, problem: str) -> TierError:
    return TierError(code or errno.EIO, f"tier {name}: {path} {problem}")
