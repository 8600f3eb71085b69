"""A durable tier that is a POSIX directory (local NVMe, or a Lustre/GPFS mount).

Layout: ``<root>/step-N/`` is a committed checkpoint; ``<root>/step-N.partial/`` is one being
written (or left by a crash). The commit protocol of DESIGN.md lives here: fsync the files, write
the manifest last (itself via fsync + rename), rename the partial directory to its final name and
fsync the parent, so that after a crash a directory either is a complete checkpoint or is not one.

A tier takes one writing process (see :mod:`tiers.locks`): the first :meth:`FilesystemTier.begin`
claims the tier's writer lock, held until :meth:`FilesystemTier.release`, and a second job pointed
at the same directory fails its checkpoints with a :class:`TierInUseError` naming the first one's
host and pid. Each partial directory is locked by its writer from creation to commit or abort, so
garbage collection, a migration or another runner leaves it alone.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tierstate.errors import TierstateError

from . import faults
from .format import (
    MANIFEST_NAME,
    Manifest,
    ManifestBody,
    ManifestError,
    manifest_bytes,
    read_manifest,
    write_durably,
)
from .locks import HeldLock, InUseError, TierClaim, claim_tier, create_locked

STEP_DIR_RE = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"


class TierError(TierstateError, OSError):
    """A tier operation failed; the message names the tier and the path."""


class CheckpointExistsError(TierError):
    pass


class TierInUseError(TierError, InUseError):
    """Another writer holds the tier (the message names its host and pid) or the partial directory."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _WriterLocks:
    """What one tier object holds as a writer: its share of the tier claim, and its partials' locks."""

    claim: TierClaim | None = None
    partials: dict[int, HeldLock] = field(default_factory=dict)


@dataclass(frozen=True)
class FilesystemTier:
    name: str
    root: Path
    _locks: _WriterLocks = field(default_factory=_WriterLocks, init=False, repr=False, compare=False)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def partial_dir(self, step: int) -> Path:
        return self.root / f"step-{step}{PARTIAL_SUFFIX}"

    def begin(self, step: int) -> Path:
        """Create a fresh partial directory for ``step``, locked until commit or abort.

        A leftover partial of the same step is replaced unless someone holds it. TierInUseError if
        another process writes this tier or someone holds the partial; TierError (with the errno)
        if the directory cannot be created.
        """
        partial = self.partial_dir(step)
        with self._as_tier_error(partial):
            self.root.mkdir(parents=True, exist_ok=True)
            self._claim()
        if self.step_dir(step).exists():
            raise CheckpointExistsError(
                f"tier {self.name}: checkpoint step {step} already exists at {self.step_dir(step)}"
            )
        with self._as_tier_error(partial):
            lock = create_locked(partial)
        self._locks.partials[step] = lock
        try:
            faults.point("begin", partial)
        except BaseException:
            self.abort(step)
            raise
        return partial

    @contextmanager
    def _as_tier_error(self, partial: Path) -> Iterator[None]:
        """OSErrors of creating ``partial`` as TierErrors that name the tier (and the holder, if in use)."""
        try:
            yield
        except InUseError as exc:
            raise TierInUseError(
                errno.EBUSY,
                f"tier {self.name}: {exc}; a tier directory takes one writing job, give each its own path",
            ) from None
        except OSError as exc:
            # The errno is kept so callers can tell a full disk from a read-only one without parsing text.
            where = f" ({exc.filename})" if exc.filename and exc.filename != str(partial) else ""
            raise TierError(
                exc.errno, f"tier {self.name}: cannot create {partial}: {exc.strerror or exc}{where}"
            ) from exc

    def _claim(self) -> None:
        """Hold this process's writer lock on the tier (again, if the tier was removed and recreated)."""
        held = self._locks.claim
        if held is not None and held.valid():
            return
        self._locks.claim = claim_tier(self.root)
        if held is not None:
            held.release()

    def release(self) -> None:
        """Give up the writer lock (a runner closing); another job may then write this tier."""
        claim, self._locks.claim = self._locks.claim, None
        if claim is not None:
            claim.release()

    def commit(self, step: int, manifest: Manifest | ManifestBody) -> Path:
        """Manifest last, then the atomic rename; only after this does ``step`` exist on the tier."""
        partial = self.partial_dir(step)
        for child in partial.iterdir():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())
        write_durably(partial / MANIFEST_NAME, manifest_bytes(manifest))
        fsync_dir(partial)
        faults.point("commit.manifest", partial)
        final = self.step_dir(step)
        os.rename(partial, final)  # still locked: nobody can take the directory between writing and renaming
        faults.point("commit.rename", final)
        fsync_dir(self.root)
        self._unlock(step)
        return final

    def abort(self, step: int) -> None:
        """Remove what a failed checkpoint wrote; the committed checkpoints are not touched.

        Only a partial this object created (and holds locked) is removed: another writer's stays.
        """
        if step in self._locks.partials:
            shutil.rmtree(self.partial_dir(step), ignore_errors=True)
            self._unlock(step)

    def _unlock(self, step: int) -> None:
        lock = self._locks.partials.pop(step, None)
        if lock is not None:
            lock.release()

    def steps(self) -> list[int]:
        """Committed steps, ascending: directories named step-N whose manifest is present."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in os.scandir(self.root):
            match = STEP_DIR_RE.match(entry.name)
            if match and entry.is_dir() and os.path.isfile(os.path.join(entry.path, MANIFEST_NAME)):
                found.append(int(match.group(1)))
        return sorted(found)

    def manifest(self, step: int) -> Manifest:
        manifest = read_manifest(self.step_dir(step))
        if manifest.step != step:
            raise ManifestError(f"{self.step_dir(step)}: manifest is for step {manifest.step}")
        return manifest

    def partials(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.name.endswith(PARTIAL_SUFFIX) and p.is_dir())
