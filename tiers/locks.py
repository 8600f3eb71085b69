"""Advisory locks on checkpoint directories, so retention never deletes what someone is using.

Whoever reads a committed checkpoint (restore, migrate, a background flush, verify, export) holds a
shared ``flock`` on its directory; a deletion first takes an exclusive one without waiting and gives
up if it cannot. ``flock`` locks belong to open file descriptions, so this works between threads of
one process (a trainer restoring while its flusher prunes) as well as between processes (the CLI
next to a running job). On file systems without ``flock`` (some PFS mounts) the call fails loudly
rather than pretending to lock.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierstate.errors import TierstateError


class InUseError(TierstateError, OSError):
    """The directory is locked by another reader or writer."""


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


@contextmanager
def reading(directory: Path) -> Iterator[None]:
    """Hold a shared lock on ``directory`` while reading it; FileNotFoundError if it is (being) deleted."""
    fd = _open_dir(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        # A deleter may have unpublished the directory between our open and our lock.
        try:
            same = os.stat(directory).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise FileNotFoundError(f"{directory}: deleted while it was being opened")
        yield
    finally:
        os.close(fd)


@contextmanager
def exclusive(directory: Path) -> Iterator[int]:
    """Hold an exclusive lock on ``directory`` (its fd is yielded); InUseError at once if anyone holds one."""
    fd = _open_dir(directory)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InUseError(f"{directory}: in use (being read, flushed or restored)") from None
        yield fd
    finally:
        os.close(fd)
