"""Recomputing every checksum of a committed checkpoint, without decoding or loading anything.

Restore verifies only the frames it reads; ``verify`` reads them all (data frames, the HDF5
library's own bytes, the indexes) and names each bad one by file, frame and byte range. Each pass
leaves a stamp (``verified.json``: for which manifest, when, and what was wrong) that ``tierstate
ls`` shows as state ``verified`` or ``damaged``, until the next pass replaces it. The stamp is
advisory: it is not part of the checkpoint, is never copied, and means only "was intact (or not)
when last checked".
A stamp that cannot be written (a read-only or full tier) is a warning beside the result, never a
failure.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .filesystem import FilesystemTier, InvalidEntry
from .format import ManifestError, checksum, now_iso, parse_index
from .framefile import hash_range
from .locks import reading
from .manifest import MANIFEST_NAME, Manifest
from .pieces import decoding_problem
from .records import FrameRecord
from .safeopen import UnsafeFileError, open_read, read_bytes, remove, write_durably
from .source import ByteSource, DirectorySource, ShortReadError

STAMP_NAME = "verified.json"

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


def _manifest_id(directory: Path) -> str:
    return checksum(read_bytes(directory / MANIFEST_NAME))


@dataclass(frozen=True)
class Stamp:
    """What the last full verification of a checkpoint (of this very manifest) found, and when."""

    ok: bool
    at: str
    problems: tuple[str, ...] = ()


def write_stamp(directory: Path, problems: Sequence[Problem] = ()) -> str | None:
    """Record that the checkpoint in ``directory`` has just passed a full verification, or failed it with
    ``problems``; why it could not be recorded (the directory is read-only, full or gone), or None.
    Something planted under the stamp's name is refused (UnsafeFileError), never written through."""
    try:
        stamp: dict[str, object] = {"manifest": _manifest_id(directory)}  # gone if retention pruned it meanwhile
        if problems:
            stamp |= {"damaged_at": now_iso(), "problems": [str(p) for p in problems]}
        else:
            stamp["verified_at"] = now_iso()
        write_durably(directory / STAMP_NAME, json.dumps(stamp).encode())
    except UnsafeFileError:
        raise
    except OSError as exc:
        return f"{directory / STAMP_NAME}: not recorded: {exc.strerror or exc}"
    return None


def read_stamp(directory: Path) -> Stamp | None:
    """What the last verification of the checkpoint (this very manifest) found, or None if it was not
    verified since the manifest was written."""
    try:
        stamp = json.loads(read_bytes(directory / STAMP_NAME))
        if stamp["manifest"] != _manifest_id(directory):
            return None
        if "damaged_at" in stamp:
            return Stamp(False, stamp["damaged_at"], tuple(stamp["problems"]))
        return Stamp(True, stamp["verified_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class VerifyResult:
    tier: str
    step: int
    path: Path
    bytes: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # about the stamp only: the result stands

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "step": self.step,
            "path": str(self.path),
            "ok": self.ok,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "problems": [str(p) for p in self.problems],
            "warnings": self.warnings,
        }


def invalid_result(tier: FilesystemTier, entry: InvalidEntry) -> VerifyResult:
    """The failed verification of a ``step-N`` entry that is no checkpoint (a lost manifest, a symlink):
    nothing in it is read."""
    return VerifyResult(tier.name, entry.step, entry.path, problems=[Problem(entry.what, None, entry.reason)])


def verify_step(tier: FilesystemTier, step: int, progress: Progress | None = None) -> VerifyResult:
    """Verify one committed checkpoint of ``tier``, holding it against deletion meanwhile."""
    directory = tier.step_dir(step)
    result = VerifyResult(tier.name, step, directory)
    started = time.perf_counter()
    with reading(directory):  # held through the stamp, so not StoredCheckpoint.locked: a bad manifest is a result
        try:
            manifest = tier.manifest(step)
        except ManifestError as exc:
            result.problems.append(Problem(MANIFEST_NAME, None, str(exc)))
        else:
            result.bytes = manifest.stored_bytes
            result.problems = verify_directory(directory, manifest, progress)
        manifest = directory / MANIFEST_NAME
        if manifest.is_file() and not manifest.is_symlink():  # a damaged copy stays marked until found clean
            try:
                warning = write_stamp(directory, result.problems)
            except UnsafeFileError as exc:  # something planted under the stamp's name: removed, not followed
                result.problems.append(Problem(STAMP_NAME, None, exc.reason))
                remove(directory / STAMP_NAME)
            else:
                if warning:
                    result.warnings.append(warning)
    result.seconds = time.perf_counter() - started
    return result
