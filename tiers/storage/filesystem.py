"""A durable tier that is a POSIX directory (local NVMe, or a Lustre/GPFS mount).

Layout: ``<root>/step-N/`` is a committed checkpoint; ``<root>/step-N.partial/`` is one being
written (or left by a crash). The commit protocol of DESIGN.md lives here: fsync the files, write
the manifest last (itself via fsync + rename), rename the partial directory to its final name and
fsync the parent, so that after a crash a directory either is a complete checkpoint or is not one.

A tier takes one writing process (see :mod:`tiers.storage.locks`): the first :meth:`FilesystemTier.begin`
claims the tier's writer lock, held until :meth:`FilesystemTier.release`, and a second job pointed
at the same directory fails its checkpoints with a :class:`TierInUseError` naming the first one's
host and pid. Each partial directory is locked by its writer from creation to commit or abort, so
garbage collection, a migration or another runner leaves it alone.

Nothing in a tier is followed or trusted for its name alone (see :mod:`tiers.storage.safeopen`): listings
look at each entry itself (``lstat``), so a symlink named ``step-N`` is no checkpoint, and a
``step-N`` directory without a manifest that is a regular file is no checkpoint either. Both are
reported by :meth:`FilesystemTier.invalid` rather than skipped in silence: no crash leaves a
``step-N`` without its manifest, so one is a lost checkpoint, and ls, verify, restore and gc say so.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tierstate.errors import TierstateError

from ..format.format import ManifestBody, ManifestError, manifest_bytes, read_manifest
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.names import STEP_NUMBER, STEP_PREFIX, parse_step_name, step_name
from . import faults
from .locks import HeldLock, InUseError, TierClaim, claim_tier, create_locked, exclusive
from .safeopen import is_real_dir, kind_of, make_dir, open_read, remove, write_durably
from .slotdirs import recycle

PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"  # a step being deleted by retention (see tiers.ops.retention)
_NAMED_LIKE_A_STEP_RE = re.compile(
    rf"^{STEP_PREFIX}{STEP_NUMBER}({re.escape(PARTIAL_SUFFIX)}|{re.escape(DELETING_SUFFIX)})?\Z"
)


class TierError(TierstateError, OSError):
    """A tier operation failed; the message names the tier and the path."""


class CheckpointExistsError(TierError):
    pass


class TierInUseError(TierError, InUseError):
    """Another writer holds the tier (the message names its host and pid) or the partial directory."""


@dataclass(frozen=True)
class InvalidEntry:
    """An entry of a tier named like a checkpoint that is not one, nor a leftover tierstate cleans up.

    Either a ``step-N`` directory whose manifest is missing or not a regular file (a commit writes
    the manifest before it names the directory ``step-N``, so no crash leaves one: its checkpoint
    was lost), or anything named ``step-N``, ``step-N.partial`` or ``step-N.deleting`` that is not a
    real directory (a symlink). Listed as invalid, named by verify and restore, never followed and
    never removed by tierstate: it is evidence of what happened, for a person to look at.
    """

    path: Path
    step: int
    what: str  # the name the reason is about: manifest.json, or the entry itself
    reason: str

    @property
    def named_as_checkpoint(self) -> bool:
        """Whether its name is a committed checkpoint's (``step-N``), not a partial's or deletion's."""
        return self.path.name == step_name(self.step)

    def __str__(self) -> str:
        return f"{self.what}: {self.reason}"


def _manifest_problem(directory: str) -> str | None:
    """Why the step directory ``directory`` has no manifest a reader may open; None if it has one."""
    try:
        mode = os.lstat(os.path.join(directory, MANIFEST_NAME)).st_mode
    except FileNotFoundError:
        return (
            "missing: this checkpoint lost its manifest (a commit writes it before the directory is named "
            "step-N), so it cannot be restored or verified"
        )
    if not stat.S_ISREG(mode):
        return f"is a {kind_of(mode)}, not a regular file; never followed or read"
    return None


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


Scope = Literal["node", "shared"]


@dataclass(frozen=True)
class FilesystemTier:
    """``scope``: ``node`` when each node has its own directory (local NVMe, a memory tier), holding only
    its ranks' part of a multi-rank checkpoint; ``shared`` when every rank sees the one directory."""

    name: str
    root: Path
    scope: Scope = "shared"
    #: The directory lies inside another tier (a peer copy's ``peer-<node>``): it is tierstate's own, so a
    #: symlink or anything else in its place was planted, and is never listed, read or written through.
    nested: bool = False
    #: Who writes through this object: a runner's token (its tiers, flushes and retention share one writer
    #: lock), None for this process's tools. Two owners in one process are two writers (tiers/storage/locks.py).
    owner: object | None = field(default=None, compare=False, repr=False)
    _locks: _WriterLocks = field(default_factory=_WriterLocks, init=False, repr=False, compare=False)

    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def location(self, step: int) -> Path:
        """Where ``step`` is, as :class:`tiers.reading.stored.StoredCheckpoint` takes it (a bucket gives a source)."""
        return self.step_dir(step)

    def partial_dir(self, step: int) -> Path:
        return self.root / f"{step_name(step)}{PARTIAL_SUFFIX}"

    def begin(self, step: int) -> Path:
        """Create a fresh partial directory for ``step``, locked until commit or abort.

        A leftover partial of the same step is replaced unless someone holds it. TierInUseError if
        another process writes this tier or someone holds the partial; TierError (with the errno)
        if the directory cannot be created.
        """
        partial = self.partial_dir(step)
        with self._as_tier_error(partial):
            if self.nested:
                make_dir(self.root)  # a planted symlink in its place is refused, never written through
            else:
                self.root.mkdir(parents=True, exist_ok=True)
            self._claim()
        if os.path.lexists(self.step_dir(step)):
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
        self._locks.claim = claim_tier(self.root, self.owner)
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
            fd = open_read(child)  # refuses whatever was planted in the partial: nothing is published through it
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
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

    def entries(self) -> list[os.DirEntry[str]]:
        """What the tier directory holds, each entry as itself (``lstat``, never through a symlink);
        nothing for a nested tier whose directory is not a real one (a planted ``peer-<node>`` symlink)."""
        if self.nested and not is_real_dir(self.root):
            return []
        try:
            with os.scandir(self.root) as listing:
                return list(listing)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def steps(self) -> list[int]:
        """Committed steps, ascending: real directories named step-N whose manifest is a regular file."""
        found = []
        for entry in self.entries():
            step = parse_step_name(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False) and _manifest_problem(entry.path) is None:
                found.append(step)
        return sorted(found)

    def holds(self, step: int) -> bool:
        """Whether ``step`` is committed here."""
        return step in self.steps()

    def where(self, step: int | None = None) -> str:
        """For messages: the tier's directory, or ``step``'s in it."""
        return str(self.root if step is None else self.step_dir(step))

    def as_directory(self) -> FilesystemTier:
        return self

    def as_bucket(self) -> None:
        return None

    def delete_step(self, step: int) -> None:
        """Unpublish, then remove, one committed checkpoint; InUseError if anyone holds it (a reader's
        shared lock, a migration). Crash safe: renamed to ``step-N.deleting`` (fsync'd, no longer listed or
        restorable) before its files go; a crash between leaves that, which garbage collection removes."""
        path = self.step_dir(step)
        with exclusive(path):
            doomed = self.root / f"{path.name}{DELETING_SUFFIX}"
            remove(doomed)  # left by an earlier crash in the middle of deleting this step (or planted: not followed)
            os.rename(path, doomed)
            fsync_dir(self.root)
            faults.point("prune.delete", doomed)
            if not self.nested:
                recycle(self.root, doomed)  # a memory tier's data files back to their writers' pools: slotdirs.py
            shutil.rmtree(doomed)

    def invalid(self) -> list[InvalidEntry]:
        """Entries named like checkpoints that are neither checkpoints nor leftovers, by step."""
        found = []
        for entry in self.entries():
            match = _NAMED_LIKE_A_STEP_RE.match(entry.name)
            if match is None:
                continue
            path, step = Path(entry.path), int(match.group(1))
            try:
                if not entry.is_dir(follow_symlinks=False):
                    kind = kind_of(entry.stat(follow_symlinks=False).st_mode)
                    found.append(InvalidEntry(path, step, entry.name, f"is a {kind}, not a directory; never followed"))
                elif match.group(2) is None and (problem := _manifest_problem(entry.path)) is not None:
                    found.append(InvalidEntry(path, step, MANIFEST_NAME, problem))
            except FileNotFoundError:
                continue  # removed meanwhile
        return sorted(found, key=lambda e: (e.step, e.path.name))

    def manifest(self, step: int) -> Manifest:
        manifest = read_manifest(self.step_dir(step))
        if manifest.step != step:
            raise ManifestError(f"{self.step_dir(step)}: manifest is for step {manifest.step}")
        return manifest

    def bytes_used(self) -> int:
        """The space this tier's checkpoints, partials and peer copies take (allocated blocks, as du counts
        them; alignment holes are free), for a tier whose size is bounded (a memory tier). Real directories
        only, at most :data:`_TIER_DEPTH` deep (root, a peer copy's directory, its steps, their files)."""
        return _allocated(str(self.root), _TIER_DEPTH)

    def partials(self) -> list[Path]:
        """Partial directories, ``step-N.partial`` by the strict grammar (real ones: a symlink named so is
        :meth:`invalid`; a ``step-05.partial`` is no partial of this tier's and is left alone)."""
        found = (
            e
            for e in self.entries()
            if (match := _NAMED_LIKE_A_STEP_RE.match(e.name)) is not None
            and match.group(2) == PARTIAL_SUFFIX
            and e.is_dir(follow_symlinks=False)
        )
        return sorted(Path(e.path) for e in found)


#: How deep a tier's own layout goes below its root: ``peer-<node>/step-N/<file>``.
_TIER_DEPTH = 3


def _allocated(directory: str, depth: int) -> int:
    """The allocated bytes of what ``directory`` holds, ``depth`` levels down, never through a symlink
    (an entry deleted meanwhile counts nothing)."""
    used = 0
    try:
        with os.scandir(directory) as listing:
            for entry in listing:
                try:
                    used += entry.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:
                    continue
                if depth > 1 and entry.is_dir(follow_symlinks=False):
                    used += _allocated(entry.path, depth - 1)
    except (FileNotFoundError, NotADirectoryError):
        pass
    return used
