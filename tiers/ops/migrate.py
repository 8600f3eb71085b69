"""Moving a committed checkpoint from one tier to another, resumably, with the commit protocol.

The copy lands in ``step-N.partial/`` on the target, frame by frame at the same offsets, and each
frame is read back from the target and checked against the manifest's checksum. Only then are the
indexes copied, the manifest written last and the directory renamed to ``step-N/``: the target
never lists a checkpoint that is not whole and verified.

Resuming costs no second copy of anything already good. A run that was killed leaves its partial
directory; the next run checks each frame already there against its checksum, keeps the ones that
match and copies only those missing or mismatched, so a frame copied and verified once is never
copied again, and a damaged one is never kept. Copying a checkpoint the target already holds is a
no-op, so ``migrate`` is idempotent.

Raw frames go to a target that takes O_DIRECT block by block, hashed as they are read, written past the
page cache and read back from the device (:mod:`tiers.ops.directcopy`: a fifth of the CPU of a buffered
copy). Other frames are verified first and move with ``copy_file_range`` where both tiers share a file
system (no trip through user space), else by reads and writes. Changing the container format (``fmt``) is a
rewrite instead (:mod:`tiers.format.convert`), verified the same way but not resumable.

Fault point ``migrate.frame`` (see :mod:`tiers.storage.faults`) is reached after each frame is copied and
verified; ``TIERSTATE_FAULT=migrate.frame@N`` SIGKILLs the process there, for the resume tests.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tierstate.errors import TierstateError

from ..format.container import Format
from ..format.convert import container_format, rewrite
from ..format.format import checksum, manifest_bytes
from ..format.framefile import BLOCK, hash_range, write_fully
from ..format.manifest import Manifest, NodePart
from ..format.records import FileRecord, FrameRecord
from ..reading.integrity import Problem, file_problems, frame_problem, index_problem, index_problems, object_problems
from ..reading.reader import CorruptCheckpointError
from ..reading.stored import StoredCheckpoint
from ..storage import faults
from ..storage.filesystem import FilesystemTier
from ..storage.locks import InUseError, exclusive, reading
from ..storage.nodeparts import part_marker, publish_parts
from ..storage.safeopen import make_dir, open_or_create, open_read, read_bytes, remove, write_durably
from .directcopy import DirectFrames
from .due import record_receipt
from .pacing import Pacer
from .verify import write_stamp

Progress = Callable[[int], None]
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}


class MigrateError(TierstateError, RuntimeError):
    """A migration that cannot be done as asked; names the step, the tiers and why."""


@dataclass
class MigrateReport:
    """What one migration did; ``frames_copied`` + ``frames_reused`` = ``frames``."""

    step: int
    source: str
    target: str
    path: Path | str  # the target's copy: a directory, or an s3:// prefix
    outcome: str  # "copied", "converted" or "already there"
    frames: int = 0
    frames_copied: int = 0
    frames_reused: int = 0
    bytes_copied: int = 0
    bytes_reused: int = 0
    frames_direct: int = 0  # of the frames copied, those written with O_DIRECT (tiers/ops/directcopy.py)
    seconds: float = 0.0
    moved: bool = False
    waiting_for: list[str] = field(default_factory=list)  # a node's part: nodes whose parts are not there yet

    @property
    def gbps(self) -> float:
        """Bytes copied onto the target per second, in GB/s. Frames a resumed copy found already there are
        not counted: they were read back and verified, not moved, and would inflate the rate past the disk's."""
        return self.bytes_copied / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def published(self) -> bool:
        """Whether this migration published the target's copy (not found it there already)."""
        return self.outcome != "already there"

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "path": str(self.path), "seconds": round(self.seconds, 4), "gbps": round(self.gbps, 3)}


class _FrameCopier:
    """Copies byte ranges between two files: in the kernel while it allows, else through a buffer."""

    def __init__(self) -> None:
        self._kernel = hasattr(os, "copy_file_range")
        self._buffer: bytearray | None = None

    def copy(self, src: int, dst: int, offset: int, length: int, where: str) -> None:
        end = offset + length
        while self._kernel and offset < end:
            try:
                copied = os.copy_file_range(src, dst, end - offset, offset, offset)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                self._kernel = False  # e.g. EXDEV: two file systems; go on from here through user space
                break
            if copied == 0:
                raise CorruptCheckpointError(f"{where}: truncated (source ends before byte {end})")
            offset += copied
        if offset < end:
            self._through_user_space(src, dst, offset, end, where)

    def _through_user_space(self, src: int, dst: int, offset: int, end: int, where: str) -> None:
        if self._buffer is None:
            self._buffer = bytearray(BLOCK)
        view = memoryview(self._buffer)
        while offset < end:
            got = os.preadv(src, [view[: min(BLOCK, end - offset)]], offset)
            if got == 0:
                raise CorruptCheckpointError(f"{where}: truncated (source ends before byte {end})")
            write_fully(dst, view[:got], offset)
            offset += got


class _Copy:
    """One same-format copy into a partial directory, counting what it copied and what it kept."""

    def __init__(self, report: MigrateReport, pacer: Pacer | None, progress: Progress | None) -> None:
        self.report = report
        self.pacer = pacer
        self.progress = progress or (lambda _n: None)
        self.copier = _FrameCopier()

    def data_file(self, source: Path, target: Path, record: FileRecord) -> None:
        src = open_read(source)
        try:
            dst = open_or_create(target)  # what an earlier attempt wrote there is kept and checked
            direct = DirectFrames(dst, target)
            try:
                resumed = os.fstat(dst).st_size > 0
                os.ftruncate(dst, record.size)  # bytes outside frames are holes, i.e. zeros, as in the source
                for i, frame in enumerate(record.frames):
                    if resumed and hash_range(dst, frame.offset, frame.length) == frame.checksum:
                        self.report.frames_reused += 1
                        self.report.bytes_reused += frame.length
                    else:
                        self._frame(src, dst, frame, f"{source} frame {i}", target, direct)
                    self.report.frames += 1
                    self.progress(frame.length)
                os.fsync(dst)
            finally:
                direct.close()
                os.close(dst)
        finally:
            os.close(src)

    def _frame(self, src: int, dst: int, frame: FrameRecord, source: str, target: Path, direct: DirectFrames) -> None:
        """Copy one frame (``source`` names it), verified in the source as verify and restore would, and read back
        from the target and checked: raw bytes with O_DIRECT, hashed as they are copied (tiers/ops/directcopy.py),
        else verified whole first (checksum, then decoding) and copied through the page cache. Nothing of a frame
        with a hole is written before it is verified: a forged frame over a sparse hole claims gigabytes for free."""
        back = direct.copy(src, frame, source) if direct.takes(src, frame) else None
        self.report.frames_direct += back is not None
        if back is None:
            problem = frame_problem(src, frame, source)
            if problem is not None:
                raise CorruptCheckpointError(f"{source}: {problem}; not migrating it")
            self.copier.copy(src, dst, frame.offset, frame.length, source)
            back = hash_range(dst, frame.offset, frame.length)
        if back != frame.checksum:
            raise MigrateError(f"{target}: bytes read back after copying {source} differ from the source's")
        self.report.frames_copied += 1
        self.report.bytes_copied += frame.length
        faults.point("migrate.frame", target)
        if self.pacer is not None:
            self.pacer.wait(frame.length)

    def small_file(self, source: Path, target: Path, digest: str) -> None:
        """An index: whole-file checksum, then parsed as restore-side recovery would (bounded nesting,
        the one-rank manifest it amounts to); copied whole unless the target already has it right."""
        try:
            if checksum(read_bytes(target)) == digest:
                return
        except FileNotFoundError:
            pass
        data = read_bytes(source)
        if checksum(data) != digest:
            raise CorruptCheckpointError(f"{source}: checksum mismatch (expected {digest}, got {checksum(data)})")
        problem = index_problem(data, str(source))
        if problem is not None:
            raise CorruptCheckpointError(f"{problem}; not migrating it")
        write_durably(target, data)


def _remove_strays(partial: Path, keep: set[str]) -> None:
    """Remove what an earlier attempt left that is not to be kept (another format, temporaries);
    a symlink goes by its name, what it points to is never touched."""
    for entry in partial.iterdir():
        if entry.name not in keep:
            remove(entry)


def _refuse(problems: list[Problem], where: Path) -> None:
    """A CorruptCheckpointError naming the first of ``problems`` of the checkpoint in ``where``, if any."""
    if problems:
        raise CorruptCheckpointError(f"{where / problems[0].file}: {problems[0].message}; not migrating it")


def _copy_all(
    source_dir: Path,
    manifest: Manifest,
    partial: Path,
    report: MigrateReport,
    pacer: Pacer | None,
    progress: Progress | None,
) -> Manifest:
    """Same format: resume or start the frame-by-frame copy, held to the checks of tiers/reading/integrity.py (the
    source's file sizes first, each index and frame before it is written, the objects of the copy before it
    is published); the manifest to publish is the source's."""
    _refuse(file_problems(source_dir, manifest), source_dir)
    copy = _Copy(report, pacer, progress)
    for name, digest in sorted(manifest.indexes.items()):  # small and checked whole: a bad one fails first
        copy.small_file(source_dir / name, partial / name, digest)
    for name, record in sorted(manifest.files.items()):
        copy.data_file(source_dir / name, partial / name, record)
    _refuse(object_problems(partial, manifest), source_dir)
    return manifest


def _convert(
    source_dir: Path,
    manifest: Manifest,
    partial: Path,
    report: MigrateReport,
    fmt: Format,
    align: int,
    pacer: Pacer | None,
    progress: Progress | None,
) -> Manifest:
    """Another format: rewrite from scratch (paced like a copy) and verify the result; its new manifest. The
    rewrite writes indexes of its own, so the source's are checked first, with its file sizes."""
    _refuse(file_problems(source_dir, manifest) + index_problems(source_dir, manifest), source_dir)
    _remove_strays(partial, set())
    published = rewrite(source_dir, manifest, partial, fmt, align, paced(progress, pacer))
    problems = StoredCheckpoint(partial, manifest=published).verify()
    if problems:
        raise MigrateError(f"{partial}: the rewritten checkpoint fails verification: {problems[0]}")
    report.outcome = "converted"
    report.frames = report.frames_copied = sum(len(f.frames) for f in published.files.values())
    report.bytes_copied = published.stored_bytes
    return published


def paced(progress: Progress | None, pacer: Pacer | None) -> Progress | None:
    """``progress``, also holding the writer to ``pacer``'s rate after each piece it reports."""
    if pacer is None:
        return progress

    def advance(nbytes: int) -> None:
        if progress is not None:
            progress(nbytes)
        pacer.wait(nbytes)

    return advance


def _unpublish(target: FilesystemTier, step: int) -> None:
    """Delete the target's copy of ``step`` (in another format) so that the rewritten one takes its name."""
    try:
        target.delete_step(step)
    except InUseError:
        raise MigrateError(f"step {step} on {target.name} is being read; not replacing it now") from None


def _publish(
    source_dir: Path,
    manifest: Manifest,
    target: FilesystemTier,
    report: MigrateReport,
    fmt: Format,
    align: int,
    pacer: Pacer | None,
    progress: Progress | None,
    replacing: bool = False,
) -> None:
    """Copy or rewrite into the partial directory, then commit; ``replacing``: the target holds the step in
    the other format, removed just before the commit (the source keeps the checkpoint meanwhile)."""
    partial = target.partial_dir(manifest.step)
    make_dir(partial)  # a symlink planted under the partial's name is refused, never written through
    try:
        with exclusive(partial):  # one migration of a step into a tier at a time
            if fmt == container_format(manifest, str(source_dir)):
                published = _copy_all(source_dir, manifest, partial, report, pacer, progress)
            else:
                published = _convert(source_dir, manifest, partial, report, fmt, align, pacer, progress)
            _remove_strays(partial, set(published.files) | set(published.indexes))
            if replacing:
                _unpublish(target, manifest.step)
            report.path = target.commit(manifest.step, published)
    except InUseError:
        raise MigrateError(f"step {manifest.step} is being migrated to {target.name} by another process") from None
    write_stamp(report.path)  # advisory: a tier's retention may already have pruned the copy it names


def _note_receipt(source: FilesystemTier, step: int, target: FilesystemTier) -> None:
    """Tell retention that ``target`` received the source's copy (see :func:`tiers.ops.retention.record_receipt`).

    Without the note the source copy stays pinned once the target lets go of its own (while the
    target's flush policy selects the step): the safe side, so a source that cannot take the note
    (read-only, full) does not fail a copy that is published and verified.
    """
    try:
        record_receipt(source, step, target.name)
    except OSError:
        pass


def _publish_part(
    source_dir: Path,
    manifest: Manifest,
    part: NodePart,
    target: FilesystemTier,
    report: MigrateReport,
    fmt: Format,
    pacer: Pacer | None,
    progress: Progress | None,
) -> None:
    """A node's part (tiers/storage/nodeparts.py; ``part``: the manifest's ``node_part``): its files into the shared
    partial, resumably and verified as any copy, then its marker; the global checkpoint is published once
    every node's part is there."""
    if fmt != container_format(manifest, str(source_dir)):
        raise MigrateError(
            f"step {manifest.step} on node {part.node} is one node's part: it is copied as it is; "
            "convert the published checkpoint instead"
        )
    partial = target.partial_dir(manifest.step)
    partial.mkdir(parents=True, exist_ok=True)
    with reading(partial):  # shared with the other nodes' copies; garbage collection leaves it alone
        _copy_all(source_dir, manifest, partial, report, pacer, progress)
        write_durably(partial / part_marker(part.node), manifest_bytes(manifest))
    publication = publish_parts(target, manifest.step)
    report.waiting_for = publication.missing
    report.outcome = "part copied" if report.waiting_for else "copied"
    if publication.published is not None:  # stamped once, by the node whose look published it; the others find it so
        write_stamp(publication.published)


def migrate(
    step: int,
    source: FilesystemTier,
    target: FilesystemTier,
    *,
    move: bool = False,
    fmt: Format | None = None,
    align: int = 4096,
    pacer: Pacer | None = None,
    progress: Progress | None = None,
) -> MigrateReport:
    """Copy (``move``: then delete from ``source``) committed checkpoint ``step`` to ``target``.

    ``fmt`` rewrites it as ``frames`` or ``hdf5`` (also a copy the target holds in the other format);
    None keeps its format. A node's part (on a node-scoped tier) is copied to a shared ``target`` as
    one part of the global checkpoint, published once every node's part is there (``waiting_for``
    names the nodes still missing); to another node-scoped tier (memory to NVMe) it is copied as it
    is, a part again. Raises MigrateError,
    CorruptCheckpointError (the source is damaged), ManifestError or OSError; never leaves the
    target with a committed but incomplete checkpoint.
    """
    if source.root.resolve() == target.root.resolve():
        raise MigrateError(f"tiers {source.name} and {target.name} are the same directory ({source.root})")
    if step not in source.steps():
        raise MigrateError(f"tier {source.name} has no committed checkpoint step {step} (in {source.root})")
    started = time.perf_counter()
    source_dir = source.step_dir(step)
    report = MigrateReport(step, source.name, target.name, target.step_dir(step), "copied")
    with reading(source_dir):
        manifest = source.manifest(step)
        wanted = fmt or container_format(manifest, str(source_dir))
        existing = target.manifest(step) if step in target.steps() else None
        if existing is not None and not existing.same_checkpoint(manifest):
            raise MigrateError(
                f"tier {target.name} already holds a different checkpoint for step {step} "
                f"(created {existing.created}; the one on {source.name} was created {manifest.created})"
            )
        if existing is not None and (fmt is None or fmt == container_format(existing, str(report.path))):
            report.outcome = "already there"
            if move:  # the source goes away, so the copy that stays must be proven good first
                problems = StoredCheckpoint(target.step_dir(step), step, existing).verify()
                if problems:
                    raise MigrateError(f"not moving step {step}: the copy on {target.name} is damaged: {problems[0]}")
        elif manifest.node_part is not None and target.scope == "shared":
            _publish_part(source_dir, manifest, manifest.node_part, target, report, wanted, pacer, progress)
        else:
            _publish(source_dir, manifest, target, report, wanted, align, pacer, progress, existing is not None)
    if move and report.waiting_for:
        raise MigrateError(
            f"not moving step {step}: its global checkpoint on {target.name} still lacks the parts of "
            f"node(s) {', '.join(report.waiting_for)}, so this part is still needed"
        )
    if move:
        source.delete_step(step)
        report.moved = True
    else:
        _note_receipt(source, step, target)
    report.seconds = time.perf_counter() - started
    return report
