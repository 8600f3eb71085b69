"""Recomputing every checksum of a committed checkpoint, without decoding or loading anything.

Restore verifies only the frames it reads; ``verify`` reads them all (data frames, the HDF5
library's own bytes, the indexes) and names each bad one by file, frame and byte range. A clean
pass leaves a stamp (``verified.json``: when, and for which manifest) that ``tierstate ls`` shows
as state ``verified``; a failed pass removes it. The stamp is advisory: it is not part of the
checkpoint, is never copied, and means only "was intact when last checked". So a stamp that cannot
be written or removed (a read-only or full tier) is a warning beside the result, never a failure.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .filesystem import FilesystemTier
from .format import MANIFEST_NAME, FrameRecord, Manifest, ManifestError, checksum, now_iso, write_durably
from .framefile import hash_range
from .locks import reading

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


def frame_problem(fd: int, frame: FrameRecord) -> str | None:
    """Why the frame's bytes in ``fd`` are not the ones its checksum names, or None when they are."""
    actual = hash_range(fd, frame.offset, frame.length)
    span = f"bytes {frame.offset}..{frame.offset + frame.length}"
    if actual is None:
        return f"{span}: truncated"
    if actual != frame.checksum:
        return f"{span}: checksum mismatch (expected {frame.checksum}, got {actual})"
    return None


def _unreadable(exc: OSError) -> str:
    return f"cannot read: {exc.strerror or exc}"


def verify_directory(directory: Path, manifest: Manifest, progress: Progress | None = None) -> list[Problem]:
    """Every problem with the data files and indexes in ``directory`` against ``manifest``."""
    advance = progress or (lambda _n: None)
    problems: list[Problem] = []
    for name, record in sorted(manifest.files.items()):
        try:
            fd = os.open(directory / name, os.O_RDONLY)
        except FileNotFoundError:
            problems.append(Problem(name, None, "missing"))
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
            actual = checksum((directory / name).read_bytes())
        except FileNotFoundError:
            problems.append(Problem(name, None, "missing"))
            continue
        except OSError as exc:
            problems.append(Problem(name, None, _unreadable(exc)))
            continue
        if actual != digest:
            problems.append(Problem(name, None, f"checksum mismatch (expected {digest}, got {actual})"))
    return problems


def _manifest_id(directory: Path) -> str:
    return checksum((directory / MANIFEST_NAME).read_bytes())


def write_stamp(directory: Path) -> str | None:
    """Record that the checkpoint in ``directory`` has just passed a full verification; why it could
    not be recorded (the directory is read-only, full or gone), or None."""
    try:
        stamp = {"manifest": _manifest_id(directory), "verified_at": now_iso()}
        write_durably(directory / STAMP_NAME, json.dumps(stamp).encode())
    except OSError as exc:
        return f"{directory / STAMP_NAME}: not recorded: {exc.strerror or exc}"
    return None


def remove_stamp(directory: Path) -> str | None:
    """Withdraw the stamp of a checkpoint that failed verification; why it could not be, or None."""
    try:
        (directory / STAMP_NAME).unlink(missing_ok=True)
    except OSError as exc:
        return f"{directory / STAMP_NAME}: not removed: {exc.strerror or exc}"
    return None


def read_stamp(directory: Path) -> str | None:
    """When the checkpoint (this very manifest) last passed verification, or None."""
    try:
        stamp = json.loads((directory / STAMP_NAME).read_bytes())
        return stamp["verified_at"] if stamp["manifest"] == _manifest_id(directory) else None
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


def verify_step(tier: FilesystemTier, step: int, progress: Progress | None = None) -> VerifyResult:
    """Verify one committed checkpoint of ``tier``, holding it against deletion meanwhile."""
    directory = tier.step_dir(step)
    result = VerifyResult(tier.name, step, directory)
    started = time.perf_counter()
    with reading(directory):
        try:
            manifest = tier.manifest(step)
        except ManifestError as exc:
            result.problems.append(Problem(MANIFEST_NAME, None, str(exc)))
        else:
            result.bytes = manifest.stored_bytes
            result.problems = verify_directory(directory, manifest, progress)
        warning = write_stamp(directory) if result.ok else remove_stamp(directory)
        if warning:
            result.warnings.append(warning)
    result.seconds = time.perf_counter() - started
    return result
