"""Where a stored checkpoint's bytes come from: the small protocol every reading layer reads through.

A checkpoint is a handful of named objects (``manifest.json``, data files, indexes). The readers
need four things of the place holding them, and nothing else: the names there, an object's size, a
byte range of an object read into a buffer the reader owns (so bytes land once, straight where they
belong), and a whole small object (a manifest, an index). A directory implements it
(:class:`DirectorySource`), and so does a bucket prefix (:class:`tiers.storage.s3tier.BucketSource`), read by
the same code. Checksums are not the source's business: the layers above verify every byte they are given.

Contract for an implementation:

- ``where`` names the location in errors (a path, ``s3://bucket/prefix``);
- ``names()`` lists the objects directly at the location (no recursion), in any order;
- ``size(name)`` is the object's length in bytes; FileNotFoundError if there is none of that name;
- ``read_into(name, offset, buffer)`` fills all of ``buffer`` from byte ``offset`` of the object,
  or raises: :class:`ShortReadError` if the object ends first, FileNotFoundError if it is missing,
  another OSError for a storage failure. It must be safe to call from several threads at once;
- ``read_small(name)`` is the whole object (callers use it only for objects they bound themselves);
  FileNotFoundError if missing;
- no call follows a link or reads outside the location; an object that is not a plain one (a
  symlink, a FIFO planted under a checkpoint's name) is refused with an OSError naming it.

Two capabilities beside the four calls, so that readers ask what a source can do, never what class
it is: ``local_directory`` is the directory holding the objects as plain files (the fastest readers
use file descriptors on them: scatter reads straight into tensors, sparse-file checks), None for a
remote source; ``reading()`` holds the location against deletion while it is read (a shared lock that
retention and migration respect on a directory; nothing to hold on a bucket prefix, whose
publication is its manifest object).
"""

from __future__ import annotations

import errno
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, runtime_checkable

from tierstate.errors import TierstateError

from ..storage.locks import reading
from ..storage.safeopen import check_regular, open_read, read_bytes


class ShortReadError(TierstateError, OSError):
    """An object ended before the byte range asked of it: the stored object is shorter than claimed."""


@runtime_checkable
class ByteSource(Protocol):
    """Read access to the objects of one stored checkpoint (see the module docstring for the contract)."""

    @property
    def where(self) -> str: ...

    def names(self) -> list[str]: ...

    def size(self, name: str) -> int: ...

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None: ...

    def read_small(self, name: str) -> bytes: ...

    @property
    def local_directory(self) -> Path | None: ...

    def reading(self) -> AbstractContextManager[None]: ...


class DirectorySource:
    """A checkpoint directory as a :class:`ByteSource`: objects are the regular files in it."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @property
    def local_directory(self) -> Path:
        return self.directory

    def reading(self) -> AbstractContextManager[None]:
        return reading(self.directory)

    @property
    def where(self) -> str:
        return str(self.directory)

    def __repr__(self) -> str:
        return f"DirectorySource({self.directory})"

    def names(self) -> list[str]:
        with os.scandir(self.directory) as entries:
            return [e.name for e in entries if e.is_file(follow_symlinks=False)]

    def size(self, name: str) -> int:
        return check_regular(self.directory / name).st_size

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        fd = open_read(self.directory / name)
        try:
            done = 0
            while done < len(buffer):
                got = os.preadv(fd, [buffer[done:]], offset + done)
                if got == 0:
                    raise ShortReadError(
                        errno.EIO,
                        f"{self.directory / name}: ends at byte {offset + done}, "
                        f"{len(buffer) - done} byte(s) short of {offset + len(buffer)}",
                    )
                done += got
        finally:
            os.close(fd)

    def read_small(self, name: str) -> bytes:
        return read_bytes(self.directory / name)


def as_source(location: Path | ByteSource) -> ByteSource:
    """``location`` as a :class:`ByteSource`: a path is read as a directory."""
    return DirectorySource(location) if isinstance(location, Path) else location
