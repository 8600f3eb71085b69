"""Recomputing every checksum of a checkpoint's files against its manifest, without decoding items.

The checks themselves, for every copy that must be trusted: ``tierstate verify`` and its stamps
(tiers/verify.py) through the read object (``StoredCheckpoint.verify``), migration before it
publishes, a peer copy and a bucket download before they commit. Data frames are checksummed and,
if compressed, decoded to their stated end; indexes are checksummed and parsed. Each bad file or
frame is named as a :class:`Problem`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .format import ManifestError, checksum, parse_index
from .framefile import hash_range
from .manifest import Manifest
from .pieces import decoding_problem
from .records import FrameRecord
from .safeopen import UnsafeFileError, open_read, read_bytes
from .source import ByteSource, DirectorySource, ShortReadError

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Problem:
    """One bad file or frame of a checkpoint."""

    file: str
    frame: int | None
    message: str

    def __str__(self) -> str:
        where = self.file if self.frame is None else f"{self.file} frame {self.frame}"
        return f"{where}: {self.message}"


def frame_problem(fd: int, frame: FrameRecord, where: str = "") -> str | None:
    """Why the frame in ``fd`` is not what its record says, or None when it is: its stored bytes
    are the ones its checksum names, and they decode to its raw length as a restore would decode
    them (checked in that order: nothing is decoded before it is verified)."""
    actual = hash_range(fd, frame.offset, frame.length)
    span = f"bytes {frame.offset}..{frame.offset + frame.length}"
    if actual is None:
        return f"{span}: truncated"
    if actual != frame.checksum:
        return f"{span}: checksum mismatch (expected {frame.checksum}, got {actual})"
    decoded = decoding_problem(fd, frame, where or span)
    return None if decoded is None else f"{span}: {decoded}"


def index_problem(data: bytes, name: str) -> str | None:
    """Why an index whose checksum matched is not one (undecodable, nested beyond bounds, not the
    one-rank manifest it must amount to), or None when it is."""
    try:
        parse_index(data, name)
    except ManifestError as exc:
        return str(exc)
    return None


def verify_directory(directory: Path, manifest: Manifest, progress: Progress | None = None) -> list[Problem]:
    """Every problem with the data files and indexes in ``directory`` against ``manifest``."""
    advance = progress or (lambda _n: None)
    problems: list[Problem] = []
    for name, record in sorted(manifest.files.items()):
        try:
            fd = open_read(directory / name)
        except (FileNotFoundError, UnsafeFileError) as exc:
            problems.append(Problem(name, None, _unreadable(exc)))
            advance(record.size)
            continue
        except OSError as exc:
            problems.append(Problem(name, None, _unreadable(exc)))
            advance(record.size)
            continue
        try:
            size = os.fstat(fd).st_size
            if size != record.size:
                problems.append(Problem(name, None, f"is {size} bytes, the manifest says {record.size}"))
            for i, frame in enumerate(record.frames):
                message = frame_problem(fd, frame)
                if message:
                    problems.append(Problem(name, i, message))
                advance(frame.length)
        except OSError as exc:  # a directory in the file's place, an I/O error: the rest of it is unread
            problems.append(Problem(name, None, _unreadable(exc)))
        finally:
            os.close(fd)
    for name, digest in sorted(manifest.indexes.items()):
        try:
            data = read_bytes(directory / name)
            actual = checksum(data)
        except (FileNotFoundError, UnsafeFileError) as exc:
            problems.append(Problem(name, None, _unreadable(exc)))
            continue
        except OSError as exc:
            problems.append(Problem(name, None, _unreadable(exc)))
            continue
        if actual != digest:
            problems.append(Problem(name, None, f"checksum mismatch (expected {digest}, got {actual})"))
        elif problem := index_problem(data, name):
            problems.append(Problem(name, None, problem))
    return problems


def verify_source(source: ByteSource, manifest: Manifest, progress: Progress | None = None) -> list[Problem]:
    """:func:`verify_directory` for a checkpoint in any :class:`~tiers.source.ByteSource` (a bucket
    prefix): every frame read through ``read_into``, checksummed and, if compressed, decoded to its end."""
    if isinstance(source, DirectorySource):
        return verify_directory(source.directory, manifest, progress)
    advance = progress or (lambda _n: None)
    problems: list[Problem] = []
    for name, record in sorted(manifest.files.items()):
        try:
            size = source.size(name)
        except OSError as exc:
            problems.append(Problem(name, None, _unreadable(exc)))
            advance(record.size)
            continue
        if size != record.size:
            problems.append(Problem(name, None, f"is {size} bytes, the manifest says {record.size}"))
        for i, frame in enumerate(record.frames):
            span = f"bytes {frame.offset}..{frame.offset + frame.length}"
            stored = bytearray(frame.length)
            try:
                source.read_into(name, frame.offset, memoryview(stored))
            except ShortReadError:
                problems.append(Problem(name, i, f"{span}: truncated"))
                continue
            except OSError as exc:
                problems.append(Problem(name, None, _unreadable(exc)))
                break
            finally:
                advance(frame.length)
            actual = checksum(memoryview(stored))
            if actual != frame.checksum:
                problems.append(
                    Problem(name, i, f"{span}: checksum mismatch (expected {frame.checksum}, got {actual})")
                )
            elif decoded := decoding_problem(bytes(stored), frame, f"{source.where}/{name} frame {i}"):
                problems.append(Problem(name, i, f"{span}: {decoded}"))
    for name, digest in sorted(manifest.indexes.items()):
        try:
            data = source.read_small(name)
        except OSError as exc:
            problems.append(Problem(name, None, _unreadable(exc)))
            continue
        actual = checksum(data)
        if actual != digest:
            problems.append(Problem(name, None, f"checksum mismatch (expected {digest}, got {actual})"))
        elif problem := index_problem(data, name):
            problems.append(Problem(name, None, problem))
    return problems


def _unreadable(exc: OSError) -> str:
    """Why a file was not read: missing, not a regular file (a planted symlink is never followed, so no
    checksum of what it points to ever appears in a report), or the storage's own error (EIO, ...)."""
    if isinstance(exc, UnsafeFileError):
        return exc.reason
    if isinstance(exc, FileNotFoundError):
        return "missing"
    return f"cannot read: {exc.strerror or exc}"
