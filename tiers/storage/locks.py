"""Advisory locks on tier directories, so nobody deletes or overwrites what someone else is using.

Three kinds, all ``flock``:

* **Readers** of a committed checkpoint (restore, migrate, a background flush, verify, export) hold a
  shared lock on its directory (:func:`reading`); a deletion first takes an exclusive one without
  waiting and gives up if it cannot (:func:`exclusive`).
* **The writer of a partial directory** holds an exclusive lock on it from its creation until it is
  committed (renamed) or removed (:func:`create_locked`), so garbage collection, a migration or
  another runner sees it in use instead of deleting or reusing it under the writer's feet.
* **The writer of a tier** holds an exclusive lock on the tier's ``.writer.lock`` file, which records
  its host and pid (:func:`claim_tier`): a second job pointed at the same directory by mistake is
  refused with a message naming the first, instead of the two committing over each other's files.
  The writer removes the file when it releases the claim; one left by a crash is simply reused.
  The claim is shared by every runner of one process (refcounted), so only other processes are
  refused; two runners of one process still never share a partial directory.

``flock`` locks belong to open file descriptions, so they work between threads of one process as
well as between processes, and the kernel drops them when their holder dies: a lock is never stale.
A forked child (a DataLoader worker) closes the descriptors it inherited, so it cannot keep a lock
alive after its parent has released it. On file systems without ``flock`` (some PFS mounts) the
call fails loudly rather than pretending to lock; on a PFS whose ``flock`` is node-local, only
writers on the same node see each other.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from tierstate.errors import TierstateError

from .safeopen import open_or_create

WRITER_LOCK_NAME = ".writer.lock"
_CREATE_ATTEMPTS = 4  # a leftover removed, then a race or two with another creator


class InUseError(TierstateError, OSError):
    """The directory is locked by another reader or writer; the message names the holder when known."""


def _open_dir(path: Path) -> int:
    # O_NOFOLLOW: a symlink planted under a lock's name is refused (ELOOP), never followed elsewhere.
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def still_there(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file or directory open as ``fd`` (not removed or replaced meanwhile)."""
    try:
        seen = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (seen.st_dev, seen.st_ino) == (held.st_dev, held.st_ino)


@contextmanager
def reading(directory: Path) -> Iterator[None]:
    """Hold a shared lock on ``directory`` while reading it; FileNotFoundError if it is (being) deleted,
    NotADirectoryError if it is a symlink: a checkpoint is read only in its own directory."""
    fd = _open_dir(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        # A deleter may have unpublished the directory between our open and our lock.
        if not still_there(directory, fd):
            raise FileNotFoundError(f"{directory}: deleted while it was being opened")
        yield
    finally:
        os.close(fd)


@contextmanager
def _creation_guard(parent: Path, mode: int) -> Iterator[None]:
    """A ``flock`` on ``parent`` that orders creating-then-locking a directory in it (exclusive mode)
    against opening-then-locking one (shared mode). Without it a collector could lock, and remove, a
    partial directory that its writer has created but not yet locked. Held only around those two
    system calls, never across I/O, so waiting for it is waiting for microseconds."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


@contextmanager
def exclusive(directory: Path) -> Iterator[int]:
    """Hold an exclusive lock on ``directory`` (its fd is yielded); InUseError at once if anyone holds one.

    FileNotFoundError if ``directory`` was removed or renamed between the open and the lock (its
    writer committed it, or someone else deleted it): what is locked is then not ``directory``.
    """
    with _creation_guard(directory.parent, fcntl.LOCK_SH):
        fd = _open_dir(directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not still_there(directory, fd):
                raise FileNotFoundError(f"{directory}: removed or renamed while it was being locked")
        except BlockingIOError:
            os.close(fd)
            raise InUseError(f"{directory}: in use (being written, read, flushed or restored)") from None
        except BaseException:
            os.close(fd)
            raise
    try:
        yield fd
    finally:
        os.close(fd)


# --- locks held beyond one call ---------------------------------------------------------------------

_held_fds: set[int] = set()  # every descriptor a HeldLock holds in this process
_held_guard = threading.Lock()


class HeldLock:
    """A descriptor holding a ``flock`` until :meth:`release` (or the process ends)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pid = os.getpid()
        with _held_guard:
            _held_fds.add(fd)

    @property
    def held(self) -> bool:
        return self.fd >= 0 and self._pid == os.getpid()

    def release(self) -> None:
        """Unlock (by closing the descriptor); a no-op the second time and in a forked child."""
        with _held_guard:
            if self.held:
                _held_fds.discard(self.fd)
                os.close(self.fd)
            self.fd = -1


def _forget_inherited() -> None:
    """In a forked child: close the lock descriptors it inherited, which would otherwise hold the
    parent's locks as long as the child lives. The parent's own descriptors still hold them."""
    global _held_guard, _claims_guard
    # The parent's guards may have been taken by a thread that does not exist here.
    _held_guard, _claims_guard = threading.Lock(), threading.Lock()
    for fd in _held_fds:
        os.close(fd)
    _held_fds.clear()
    _claims.clear()


os.register_at_fork(after_in_child=_forget_inherited)


def create_locked(directory: Path) -> HeldLock:
    """Create ``directory`` and hold an exclusive lock on it, for a writer that fills it.

    A leftover at ``directory`` that nobody holds (a crashed write) is removed first; one that
    someone holds (another runner's partial, a migration into it) is left alone: InUseError.
    """
    for _ in range(_CREATE_ATTEMPTS):
        if os.path.lexists(directory):
            try:
                with exclusive(directory):
                    shutil.rmtree(directory)
            except FileNotFoundError:
                pass  # removed by someone else meanwhile
        with _creation_guard(directory.parent, fcntl.LOCK_EX):
            try:
                directory.mkdir()
            except FileExistsError:
                continue  # created again by someone else meanwhile: a leftover, or in use
            fd = _open_dir(directory)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # locked by someone who does not take the guard: try again, as a leftover
                continue
            return HeldLock(fd)
    raise InUseError(f"{directory}: created again by someone else each time it was removed ({_CREATE_ATTEMPTS} times)")


# --- the writer of a tier ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """Who holds a tier's writer lock, as it recorded itself in the lock file."""

    host: str
    pid: int
    since: float

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"host {self.host}, pid {self.pid} (since {when})"

    @classmethod
    def me(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), time.time())

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        """The holder a lock file names; None if it names none (its holder has not written it yet)."""
        try:
            doc = json.loads(raw)
            return cls(str(doc["host"]), int(doc["pid"]), float(doc["since"]))
        except (ValueError, TypeError, KeyError):
            return None


class _SharedClaim:
    """This process's writer lock on one tier: one descriptor, counted by the runners using it."""

    def __init__(self, lock: HeldLock, path: Path, key: tuple[int, int], owner: object | None) -> None:
        self.lock = lock
        self.path = path
        self.key = key
        self.owner = owner
        self.users = 1

    def valid(self) -> bool:
        """Whether it still locks the tier: its lock file was not removed (with the tier) meanwhile."""
        return self.lock.held and still_there(self.path, self.lock.fd)

    def close(self) -> None:
        """Remove the lock file, then unlock: a tier whose writer has finished holds only checkpoints.
        Whoever locked the file meanwhile sees that it is gone, and takes a new one."""
        if self.valid():
            self.path.unlink(missing_ok=True)
        self.lock.release()


_claims: dict[tuple[int, int], _SharedClaim] = {}  # by (st_dev, st_ino) of the lock file
_claims_guard = threading.Lock()


class TierClaim:
    """One user's share of this process's writer lock on a tier; :meth:`release` gives it back."""

    def __init__(self, shared: _SharedClaim) -> None:
        self._shared: _SharedClaim | None = shared

    def valid(self) -> bool:
        return self._shared is not None and self._shared.valid()

    def release(self) -> None:
        with _claims_guard:
            shared, self._shared = self._shared, None
            if shared is None:
                return
            shared.users -= 1
            if shared.users == 0:
                if _claims.get(shared.key) is shared:
                    del _claims[shared.key]
                shared.close()


def claim_tier(root: Path, owner: object | None = None) -> TierClaim:
    """Become the writer of tier directory ``root`` for ``owner`` (a runner's token; None: this process's
    tools), or join ``owner``'s claim on it: its checkpoints, flushes and retention share one lock.

    InUseError naming the holder (host, pid) if another process writes it, or another owner of this
    process (a second runner on the same tier, as a notebook cell run twice builds): the same rule in
    and across processes. OSError if the lock file cannot be created or written (a read-only or
    missing tier) or is not a regular file (a symlink).
    """
    path = root / WRITER_LOCK_NAME
    for _ in range(_CREATE_ATTEMPTS):
        # Held read-only: an open writable file would keep the tier's file system from being remounted
        # read-only, and flock needs no write access. Never a symlink or FIFO planted under its name.
        fd = open_or_create(path, os.O_RDONLY)
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino)
        with _claims_guard:
            shared = _claims.get(key)
            if shared is not None and shared.valid():
                os.close(fd)
                if shared.owner is not owner:
                    raise InUseError(f"{root}: already written by another runner of this process ({Holder.me()})")
                shared.users += 1
                return TierClaim(shared)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if still_there(path, fd):
                    _record_holder(path)
                    shared = _claims[key] = _SharedClaim(HeldLock(fd), path, key, owner)
                    return TierClaim(shared)
            except BlockingIOError:
                holder = Holder.parse(os.pread(fd, 4096, 0))
                os.close(fd)
                named = str(holder) if holder else "another process (it has not recorded its host and pid yet)"
                raise InUseError(f"{root}: already written by {named}") from None
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # its last holder removed it while leaving: take the new one
    raise InUseError(f"{path}: removed by someone else each time it was locked ({_CREATE_ATTEMPTS} times)")


def _record_holder(path: Path) -> None:
    """Write who holds the lock into the lock file, for whoever is refused to name."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, json.dumps(asdict(Holder.me())).encode())
    finally:
        os.close(fd)
