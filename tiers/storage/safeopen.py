"""The only ways tierstate opens, creates and replaces files inside a tier: never through a symlink,
never anything but a regular file.

A tier directory may be shared with other users and jobs, so anything in it may have been planted:
a ``rank-00000.data`` that is a symlink to someone's file (a write through it would overwrite that
file, a read would hand its bytes, or their checksum, to whoever reads the error), or a FIFO named
like a checkpoint file (opening it blocks forever). So, inside a tier:

* a file is read only if ``lstat`` says it is a regular file, and it is opened with ``O_NOFOLLOW``
  and ``O_NONBLOCK`` (a FIFO swapped in meanwhile cannot block the open) and checked again with
  ``fstat`` on the descriptor before a byte is read;
* a new file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``, which fails on any existing name,
  a dangling symlink included, instead of writing through it;
* a file is replaced (:func:`write_durably`) by a temporary created the same way and a rename, and
  only if what it replaces is a regular file: a symlink at the name is refused, not replaced;
* removing an entry removes the name (``unlink``), or a real directory (``rmtree``, which never
  follows symlinks inside), never what a symlink points to.

Whatever is refused raises :class:`UnsafeFileError`, an OSError naming the path and what it is
(``is a symlink``, ``is a FIFO``), so every caller that reports storage errors reports it too.
Symlinks above the tier (the tier root itself, a mount point) are the user's configuration and
are followed as usual.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
from pathlib import Path

from tierstate.errors import TierstateError

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = (
    (stat.S_ISLNK, "symlink"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISREG, "regular file"),
)


class UnsafeFileError(TierstateError, OSError):
    """A path inside a tier is not what tierstate may open there: a symlink (errno ELOOP), a FIFO,
    device, socket or directory where a regular file belongs, or an existing name where a new file
    must be created (EEXIST). It was neither followed nor opened; the message names the path."""

    def __init__(self, code: int, path: Path, reason: str) -> None:
        super().__init__(code, f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[type[UnsafeFileError], tuple[int | None, Path, str]]:
        return type(self), (self.errno, self.path, self.reason)


def kind_of(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``symlink``, ``FIFO``, ``directory``, ``regular file``..."""
    return next((name for test, name in _KINDS if test(mode)), "special file")


def _refused(path: Path, mode: int, expected: str = "a regular file") -> UnsafeFileError:
    code = errno.ELOOP if stat.S_ISLNK(mode) else errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    return UnsafeFileError(code, path, f"is a {kind_of(mode)}, not {expected}; refused (never followed or opened)")


def check_regular(path: Path) -> os.stat_result:
    """``lstat`` of ``path``, which must be a regular file; FileNotFoundError if there is none."""
    seen = os.lstat(path)
    if not stat.S_ISREG(seen.st_mode):
        raise _refused(path, seen.st_mode)
    return seen


def is_real_dir(path: Path) -> bool:
    """Whether ``path`` is a directory itself, not a symlink to one (False if it does not exist)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _checked(fd: int, path: Path) -> int:
    """``fd`` if it is a regular file, with O_NONBLOCK cleared again; else closed and refused."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refused(path, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` without following a final symlink; ELOOP from the kernel becomes UnsafeFileError."""
    try:
        return os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a symlink after the lstat
            raise UnsafeFileError(errno.ELOOP, path, "is a symlink; refused (never followed)") from None
        raise


def open_read(path: Path) -> int:
    """A read-only descriptor on the regular file ``path``; FileNotFoundError if it is missing."""
    check_regular(path)
    return _checked(_open(path, os.O_RDONLY), path)


def read_bytes(path: Path) -> bytes:
    """The whole content of the regular file ``path``."""
    with os.fdopen(open_read(path), "rb") as handle:
        return handle.read()


def open_existing(path: Path, flags: int = os.O_RDWR) -> int:
    """A descriptor on the existing regular file ``path`` (e.g. one the HDF5 library just created)."""
    check_regular(path)
    return _checked(_open(path, flags), path)


def open_or_create(path: Path, flags: int = os.O_RDWR) -> int:
    """A descriptor on the regular file ``path``, created empty if missing: for resumable copies,
    which keep what an earlier attempt wrote there."""
    try:
        check_regular(path)
    except FileNotFoundError:
        pass
    return _checked(_open(path, flags | os.O_CREAT), path)


def _taken(path: Path) -> UnsafeFileError:
    try:
        what = f"a {kind_of(os.lstat(path).st_mode)}"
    except FileNotFoundError:
        what = "something, removed since"
    return UnsafeFileError(errno.EEXIST, path, f"already exists ({what}); a new file is never written over it")


def check_absent(path: Path) -> None:
    """Refuse (EEXIST) if anything, a dangling symlink included, has the name ``path``."""
    if os.path.lexists(path):
        raise _taken(path)


def create_new(path: Path, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """A new, empty regular file at ``path``; UnsafeFileError (EEXIST) if anything has that name."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise _taken(path) from None


def reopen(fd: int, path: Path, flags: int) -> int:
    """A second descriptor on the file open as ``fd`` (at ``path``), e.g. with O_DIRECT; refused
    unless ``path`` still names that very file."""
    second = os.open(path, flags | _NOFOLLOW)
    first, again = os.fstat(fd), os.fstat(second)
    if (first.st_dev, first.st_ino) != (again.st_dev, again.st_ino):
        os.close(second)
        raise UnsafeFileError(errno.ESTALE, path, "replaced by another file while it was being opened; refused")
    return second


def remove(path: Path) -> None:
    """Remove the entry ``path``: a real directory with everything in it, anything else by its name
    only (a symlink goes, what it points to stays). Nothing there is fine."""
    try:
        real_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return
    if real_dir:
        shutil.rmtree(path)  # never follows a symlink inside, and refuses one at the top
    else:
        path.unlink(missing_ok=True)


def make_dir(path: Path) -> None:
    """Create directory ``path`` (and its parents); an existing entry must be a real directory."""
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        mode = os.lstat(path).st_mode
        if not stat.S_ISDIR(mode):
            raise _refused(path, mode, "a directory") from None


def write_durably(path: Path, data: bytes) -> None:
    """Write via a temporary name, fsync, then rename: a reader sees the whole file or none.

    The temporary is hidden and named for this writer alone (``.NAME.PID.RANDOM.tmp``, created new), so two
    processes stamping the same file at once (two nodes publishing one step, ``tierstate verify`` during a
    flush) each rename a whole file of their own, the last one winning; neither removes the other's. One
    left by a crash stays a hidden stray of its directory, which no reader takes for a checkpoint's file; the
    one name older versions used for every writer (``NAME.tmp``, left by their crash or planted) is removed by
    its name. ``path`` itself is replaced only if it is missing or a regular file.
    """
    try:
        check_regular(path)
    except FileNotFoundError:
        pass
    remove(path.with_name(path.name + ".tmp"))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = create_new(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
