"""The checks of a stored checkpoint: one set, for restore, verify and migrate alike, on a directory or a bucket.

A manifest's sizes are claims and its checksum an integrity check, not a signature (a forger re-signs
it), so every copy is held to these, each failure a :class:`Problem` naming file and frame:

1. its files (:func:`file_problems`): every data file the manifest lists is there, a plain object,
   exactly as long as the manifest says, so no frame claims bytes the storage does not hold and
   nothing is allocated or read for such a claim;
2. its indexes (:func:`index_problems`): the checksum the manifest gives them, then parsed as the
   one-rank manifest each must amount to;
3. its frames (:func:`frame_problem`, and the read path of tiers/reading/pieces.py): the checksum of the
   stored bytes, then, compressed, decoded to the end, to exactly the raw length stated;
4. its objects (:func:`object_problems`): each object item decodes with the serializer it names (a
   pickle is parsed, never loaded).

``verify`` (:func:`verify_source`; tiers/ops/verify.py and its stamps, a peer copy and a bucket transfer
before they commit, a converted copy) runs all four on everything. A restore runs 1 and 2 before it
reads (:func:`admit`: every file, and the indexes of the files it reads), 3 on every frame it reads
and 4 as it decodes. Migration runs 1 before it copies, 2 and 3 on each index and frame before it
writes a byte of it, and 4 on the copy before it publishes. So a copy one of them rejects, the others
reject too.
"""

from __future__ import annotations

import os
import pickletools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..format.format import ManifestError, checksum, parse_index
from ..format.framefile import hash_range
from ..format.manifest import Manifest
from ..format.names import data_file_rank, index_file_name
from ..format.objcodec import ObjectCodecError, decode_object
from ..format.records import AnyRecord, FrameRecord, ObjectRecord, PerRankRecord
from ..storage.safeopen import UnsafeFileError, open_read
from .pieces import CorruptCheckpointError, decoding_problem, read_records
from .source import ByteSource, ShortReadError, as_source

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


# --- 1. files -----------------------------------------------------------------------------------------
def file_problems(location: Path | ByteSource, manifest: Manifest) -> list[Problem]:
    """Every data file the manifest lists that is missing, not a plain object, or not exactly the size the
    manifest gives it (shorter: frames claim bytes that are not there; longer: bytes it does not account
    for). Reads nothing but the sizes."""
    source = as_source(location)
    problems = []
    for name, record in sorted(manifest.files.items()):
        try:
            size = source.size(name)
        except OSError as exc:
            problems.append(Problem(name, None, _unreadable(exc)))
            continue
        if size < record.size:  # named by its first frame not stored whole
            cut = next((i for i, f in enumerate(record.frames) if f.offset + f.length > size), None)
            problems.append(Problem(name, cut, f"truncated ({size} bytes stored, the manifest says {record.size})"))
        elif size > record.size:
            problems.append(Problem(name, None, f"is {size} bytes, the manifest says {record.size}"))
    return problems


# --- 2. indexes ---------------------------------------------------------------------------------------
def index_problem(data: bytes, name: str) -> str | None:
    """Why an index whose checksum matched is not one (undecodable, nested beyond bounds, not the
    one-rank manifest it must amount to), or None when it is."""
    try:
        parse_index(data, name)
    except ManifestError as exc:
        return str(exc)
    return None


def index_problems(
    location: Path | ByteSource, manifest: Manifest, names: Collection[str] | None = None
) -> list[Problem]:
    """Every index (of ``names``; all by default) that is unreadable, fails the checksum the manifest gives
    it, or does not parse."""
    source = as_source(location)
    problems = []
    for name in sorted(manifest.indexes if names is None else names):
        digest = manifest.indexes[name]
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


def indexes_of(manifest: Manifest, files: Collection[str]) -> list[str]:
    """The indexes of the ranks whose data files are ``files`` (those the manifest lists)."""
    ranks = {data_file_rank(name) for name in files}
    return [name for rank in ranks if rank is not None and (name := index_file_name(rank)) in manifest.indexes]


# --- 3. frames ----------------------------------------------------------------------------------------
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


def _frames_of_file(source: ByteSource, name: str, frames: list[FrameRecord], progress: Progress) -> Iterator[Problem]:
    """The problems of one file's frames (its size already checked: frames past its end are truncated, and
    are neither allocated for nor read)."""
    try:
        size = source.size(name)
    except OSError:
        progress(sum(frame.length for frame in frames))
        return  # reported by file_problems
    directory = source.local_directory
    if directory is not None:
        yield from _directory_frames(directory / name, frames, progress)
        return
    for i, frame in enumerate(frames):
        span = f"bytes {frame.offset}..{frame.offset + frame.length}"
        try:
            if frame.offset + frame.length > size:
                yield Problem(name, i, f"{span}: truncated (the object has {size} bytes)")
                continue
            stored = bytearray(frame.length)  # bounded by the object's real size, checked just above
            source.read_into(name, frame.offset, memoryview(stored))
        except ShortReadError:
            yield Problem(name, i, f"{span}: truncated")
            continue
        except OSError as exc:
            yield Problem(name, None, _unreadable(exc))
            return
        finally:
            progress(frame.length)
        actual = checksum(memoryview(stored))
        if actual != frame.checksum:
            yield Problem(name, i, f"{span}: checksum mismatch (expected {frame.checksum}, got {actual})")
        elif decoded := decoding_problem(bytes(stored), frame, f"{source.where}/{name} frame {i}"):
            yield Problem(name, i, f"{span}: {decoded}")


def _directory_frames(path: Path, frames: list[FrameRecord], progress: Progress) -> Iterator[Problem]:
    """A directory's file, through one descriptor: holes are hashed, not read, truncation found by the hash."""
    try:
        fd = open_read(path)
    except OSError as exc:
        yield Problem(path.name, None, _unreadable(exc))
        return
    try:
        for i, frame in enumerate(frames):
            message = frame_problem(fd, frame)
            if message:
                yield Problem(path.name, i, message)
            progress(frame.length)
    except OSError as exc:  # a directory in the file's place, an I/O error: the rest of it is unread
        yield Problem(path.name, None, _unreadable(exc))
    finally:
        os.close(fd)


# --- 4. objects ---------------------------------------------------------------------------------------
def _object_records(manifest: Manifest) -> dict[str, ObjectRecord]:
    """Every object record (per-rank values each on its own), keyed for messages, whose bytes are in the
    files this copy holds (a node's part lacks other nodes')."""
    found: dict[str, ObjectRecord] = {}

    def add(key: str, record: AnyRecord) -> None:
        if isinstance(record, ObjectRecord) and all(p.file in manifest.files for p in record.pieces):
            found[key] = record
        elif isinstance(record, PerRankRecord):
            for rank, part in record.ranks.items():
                add(f"{key} (rank {rank})", part)

    for key, record in manifest.items.items():
        add(key, record)
    return found


def _pickle_problem(data: bytes) -> str | None:
    """Whether ``data`` is one well-formed pickle stream, told by parsing its opcodes (nothing is loaded)."""
    try:
        for _op, _arg, _pos in pickletools.genops(data):
            pass
    except Exception as exc:  # genops raises ValueError and more on garbage; all mean "no pickle"
        return f"not a pickle stream ({type(exc).__name__}: {exc})"
    return None


def object_problems(location: Path | ByteSource, manifest: Manifest) -> list[Problem]:
    """Every object item that does not decode with the serializer it names (its frames verified on the way;
    a frame that fails is reported as that)."""
    records = _object_records(manifest)
    if not records:
        return []
    try:
        stored = read_records(location, manifest, records)
    except CorruptCheckpointError as exc:
        return [Problem("(objects)", None, str(exc))]
    problems = []
    for key, record in records.items():
        data = bytes(stored[key].numpy())
        try:
            problem = _pickle_problem(data) if record.serializer == "pickle" else None
            if record.serializer != "pickle":
                decode_object(data, record.serializer)
        except ObjectCodecError as exc:
            problem = str(exc)
        if problem is not None:
            file = record.pieces[0].file if record.pieces else "(no file)"
            problems.append(Problem(file, None, f"item {key!r}, stored as {record.serializer}: {problem}"))
    return problems


# --- all of them ---------------------------------------------------------------------------------------
def verify_source(location: Path | ByteSource, manifest: Manifest, progress: Progress | None = None) -> list[Problem]:
    """Every problem of the checkpoint at ``location`` (a directory or any byte source) against ``manifest``:
    the four checks of the module docstring on every file, frame, index and object."""
    advance = progress or (lambda _n: None)
    source = as_source(location)
    problems = file_problems(source, manifest)
    for name, record in sorted(manifest.files.items()):
        problems += _frames_of_file(source, name, record.frames, advance)
    problems += index_problems(source, manifest)
    if not problems:  # objects are read through their frames: a bad frame is already named
        problems += object_problems(source, manifest)
    return problems


def admit(location: Path | ByteSource, manifest: Manifest, files: Collection[str] | None = None) -> None:
    """What a restore checks before it reads a byte of data: every data file of the right size, and the
    indexes of ``files`` (the data files it reads; all by default). CorruptCheckpointError naming the first
    problem, so a forged copy costs no allocation and the next copy is tried."""
    source = as_source(location)
    problems = file_problems(source, manifest)
    problems += index_problems(source, manifest, indexes_of(manifest, manifest.files if files is None else files))
    if problems:
        raise CorruptCheckpointError(f"{source.where}/{problems[0]}")


def _unreadable(exc: OSError) -> str:
    """Why a file was not read: missing, not a regular file (a planted symlink is never followed, so no
    checksum of what it points to ever appears in a report), or the storage's own error (EIO, ...)."""
    if isinstance(exc, UnsafeFileError):
        return exc.reason
    if isinstance(exc, FileNotFoundError):
        return "missing"
    return f"cannot read: {exc.strerror or exc}"
