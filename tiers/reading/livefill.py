"""Restoring straight into live tensors: every frame verified first, then read once into its destination.

Why not read into fresh buffers and copy them over: fresh memory must be faulted in page by page (on
the 2-core VM of benchmarks/RESULTS.md ~2 us per 4 KiB page, 0.9 s for the 1.52 GB GPT state), where
one memcpy of the same bytes into the live tensors takes 0.1-0.15 s. The live tensors are already
faulted in, so the bytes go there, and only there, in two passes over the frames that hold them,
each pass spread over threads (``preadv`` and xxh3 release the GIL):

1. :meth:`LiveFill.verify`: each such frame hashed whole through a small block per thread that
   stays in cache; a mismatch (or a truncated or unreadable file) fails the read before any live
   tensor is touched, so the copy is at fault and the next one may be tried.
2. :meth:`LiveFill.fill`, run by the restore after the providers without ``check`` restored and
   before the checked ones (providers/atomic.py): each frame read again, every destination's piece
   straight into the tensor's own bytes (one scatter ``preadv``), the bytes between pieces through
   the block, and the frame hashed again from the bytes that landed, so every byte restored is
   checked. A destination that is not CPU memory (a GPU tensor) is filled through a staging block
   (pinned when CUDA is present) and copied from there, a block at a time.

Why verify twice rather than once: with one pass the bytes would be in the live tensors before
the last frame is checked, and a corrupt frame would leave the model half restored; a restore
that fails leaves the live state as it was (providers/base.py). The second hash costs one pass of
xxh3 over bytes already in cache. The files stay open from the first pass to the second, so
retention may unlink them meanwhile but not swap them: a frame that still hashes differently in
the second pass was changed in place under the read lock (a hostile writer, failing memory), and
the restore fails saying that the checked providers' tensors were partly overwritten.

Into fresh tensors (a model :func:`~providers.materialize.materialize` just built, untouched since:
providers/fresh.py) there is no state to leave as it was: :meth:`LiveFill.fill_once` is the second pass
alone, at read time, each byte copied once and hashed as it lands, and a mismatch fails the read like
one found by :meth:`~LiveFill.verify`, so the restore goes on to the next copy.

Only plain tensors qualify (same dtype and shape as stored, contiguous, not a DTensor, storage not
shared with another destination) in uncompressed frames; every other item is read into a buffer of its
own (:func:`tiers.reading.reader.read_view`) and copied by its provider.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch
import xxhash

from tierstate.errors import TierstateError

from ..format.dtypes import dtype_from_name
from ..format.framefile import feed_range
from ..format.manifest import Manifest
from ..format.records import FrameRecord, Piece, TensorRecord
from .pieces import IOV_MAX, CorruptCheckpointError, check_frame, opened_files, scatter_read, tensor_bytes, unreadable

BLOCK = 256 << 10  # per thread: one read's worth, hashed while still in cache (the L2 of the test VM)
STAGING = 4 << 20  # per thread, pinned with CUDA: few enough host-to-device copies per GB (each one waits)
Targets = list[tuple[str, Piece]]


def fits(tensor: object, record: TensorRecord) -> bool:
    """Whether the stored bytes of ``record`` may be read straight into ``tensor``: a plain, contiguous,
    non-empty tensor of the stored dtype and shape (a DTensor's or a non-contiguous tensor's values
    are not one byte range; those go the way of every other item)."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and isinstance(tensor, torch.Tensor)
        and tensor.numel() > 0
        and tensor.is_contiguous()
        and not tensor.is_meta
        and tensor.dtype == dtype_from_name(record.dtype)
        and tuple(tensor.shape) == tuple(record.shape)
    )


def _plain_frame(frame: FrameRecord, targets: Targets) -> bool:
    """Uncompressed, and the destination pieces lie inside it without overlapping (a forged manifest
    could claim otherwise; such a frame is read into a buffer of its own, which copes with it)."""
    if frame.codec != "none" or frame.shuffle != 1:
        return False
    position = 0
    for _, piece in sorted(targets, key=lambda kp: kp[1].offset):
        if piece.offset < position:
            return False
        position = piece.offset + piece.length
    return position <= frame.length


def plan(
    manifest: Manifest, records: Mapping[str, TensorRecord], live: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[tuple[str, int], Targets]]:
    """The destinations that qualify (see :func:`fits`, in plain frames only, none sharing storage with
    another), and the destination pieces of each frame, by (file, frame index)."""
    fitting = {key: live[key] for key, record in records.items() if key in live and fits(live[key], record)}
    storages: dict[int, int] = defaultdict(int)
    for tensor in fitting.values():
        storages[tensor.untyped_storage().data_ptr()] += 1
    chosen = {key: t for key, t in fitting.items() if storages[t.untyped_storage().data_ptr()] == 1}
    by_frame: dict[tuple[str, int], Targets] = defaultdict(list)
    for key in chosen:
        for piece in records[key].pieces:
            by_frame[(piece.file, piece.frame)].append((key, piece))
    odd = {key for (file, index), t in by_frame.items() if not _plain_frame(manifest.files[file].frames[index], t)
           for key, _ in t}  # fmt: skip
    if odd:  # a key with any piece in an odd frame is read into a buffer of its own, whole
        chosen = {key: tensor for key, tensor in chosen.items() if key not in odd}
        by_frame = defaultdict(list)
        for key in chosen:
            for piece in records[key].pieces:
                by_frame[(piece.file, piece.frame)].append((key, piece))
    return chosen, dict(by_frame)


class _Scratch(threading.local):
    """Each thread's own block, allocated once per fill."""

    def __init__(self) -> None:
        self.block = memoryview(bytearray(BLOCK))
        self.staging: torch.Tensor | None = None


class LiveFill:
    """The bytes of qualifying items, read into their live tensors: :meth:`verify` first, :meth:`fill` later.

    ``stage`` reads every destination through the staging block, CPU ones too (tests exercise the
    path a GPU restore takes on a machine without one). Holds the data files open until :meth:`fill`
    ran or :meth:`close` was called (also when it is garbage collected).
    """

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        destinations: Mapping[str, torch.Tensor],
        frames: Mapping[tuple[str, int], Targets],
        workers: int = 4,
        stage: bool = False,
    ) -> None:
        self.destinations = dict(destinations)
        self._frames = {key: sorted(t, key=lambda kp: kp[1].offset) for key, t in sorted(frames.items())}
        self._records = {key: manifest.files[key[0]].frames[key[1]] for key in self._frames}
        self._where = {key: f"{directory}/{key[0]} frame {key[1]}" for key in self._frames}
        order = list(self._frames)
        self._next = dict(zip(order, order[1:], strict=False))  # the frame read after each, to read ahead
        self._workers = max(1, min(workers, len(self._frames)))
        self._stage = stage
        self._scratch = _Scratch()
        self._stack = contextlib.ExitStack()
        self._fds = self._stack.enter_context(opened_files(directory, {file for file, _ in self._frames}))
        self._closer = weakref.finalize(self, self._stack.close)
        self.bytes_read = sum(frame.length for frame in self._records.values())
        self._verified = False
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Close the data files (the fill is given up)."""
        self._closer()

    def verify(self) -> None:
        """First pass: every frame's checksum, from the bytes on disk; nothing written anywhere."""
        self._each(self._verify_frame)
        self._verified = True

    def fill(self) -> None:
        """Second pass: read every destination's bytes into it, each frame hashed again as it lands."""
        if not self._verified:  # the second pass alone would leave a corrupt copy half applied
            self.verify()
        self._fill()

    def fill_once(self) -> None:
        """The only pass, for destinations holding nothing to protect (providers/fresh.py): every frame read
        straight into them and hashed as it lands; a mismatch fails the read (the next copy overwrites them)."""
        self._fill()

    def _fill(self) -> None:
        try:
            with torch.no_grad():
                self._each(self._fill_frame)
        finally:
            self.close()

    def _each(self, work: Callable[[tuple[str, int]], None]) -> None:
        """``work`` on every frame, spread over the pool; every one finished before the first error is raised
        (a frame still being read must not see its file closed)."""
        if self._workers == 1:
            for key in self._frames:
                work(key)
            return
        if self._pool is None:  # one pool for both passes, shut down with the files
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="tierstate-fill")
            # Not waited for: every frame's work is done by then, and a close from the pool's own thread
            # (the last reference dropped there) must not join itself.
            self._stack.callback(self._pool.shutdown, wait=False)
        futures = [self._pool.submit(work, key) for key in self._frames]
        wait(futures)
        for future in futures:
            future.result()

    @contextlib.contextmanager
    def _reading(self, key: tuple[str, int]) -> Iterator[tuple[int, FrameRecord, str]]:
        where = self._where[key]
        try:
            yield self._fds[key[0]], self._records[key], where
        except TierstateError:
            raise
        except OSError as exc:
            raise unreadable(exc, where) from None

    def _verify_frame(self, key: tuple[str, int]) -> None:
        with self._reading(key) as (fd, frame, where):
            end = frame.offset + frame.length
            size = os.fstat(fd).st_size
            if end > size:
                raise CorruptCheckpointError(f"{where}: truncated (the frame ends at byte {end}, the file has {size})")
            # A cold file: this frame and the next asked of the disk at once (the kernel reads them ahead
            # asynchronously), not in the block-sized steps the loop below takes; cached pages stay as they are.
            for ahead in (key, self._next.get(key)):
                if ahead is not None:
                    record = self._records[ahead]
                    os.posix_fadvise(self._fds[ahead[0]], record.offset, record.length, os.POSIX_FADV_WILLNEED)
            hasher = xxhash.xxh3_64()  # holes (a sparse file) hashed as the zeros they read as, not read
            fed = self._feed(fd, frame.offset, frame.length, hasher)
            check_frame(hasher.hexdigest() if fed else None, frame, where)

    def _feed(self, fd: int, offset: int, length: int, hasher: xxhash.xxh3_64) -> bool:
        return feed_range(fd, offset, length, hasher, self._scratch.block)

    def _fill_frame(self, key: tuple[str, int]) -> None:
        """The frame's pieces read into their destinations in steps of about BLOCK bytes (one scatter read
        per step, hashed while the step is still in cache), the bytes between pieces through the block."""
        with self._reading(key) as (fd, frame, where):
            hasher = xxhash.xxh3_64()
            position = 0  # in the frame: how far it is read and hashed, or queued in the step
            step: list[memoryview] = []
            step_start = step_bytes = 0

            def read_step() -> None:
                nonlocal step_bytes
                scatter_read(fd, frame.offset + step_start, step, where)
                for view in step:
                    hasher.update(view)
                step.clear()
                step_bytes = 0

            for item, piece in self._frames[key]:
                if piece.offset > position or self._staged(item):
                    read_step()
                if piece.offset > position and not self._feed(
                    fd, frame.offset + position, piece.offset - position, hasher
                ):
                    check_frame(None, frame, where)
                if self._staged(item):
                    self._stage_piece(fd, frame, item, piece, hasher, where)
                else:
                    view = self._view(item, piece)
                    for at in range(0, piece.length, BLOCK):
                        if not step:
                            step_start = piece.offset + at
                        step.append(view[at : at + BLOCK])
                        step_bytes += len(step[-1])
                        if step_bytes >= BLOCK or len(step) >= IOV_MAX:
                            read_step()
                position = piece.offset + piece.length
            read_step()
            if position < frame.length and not self._feed(fd, frame.offset + position, frame.length - position, hasher):
                check_frame(None, frame, where)
            if hasher.hexdigest() != frame.checksum and not self._verified:
                check_frame(hasher.hexdigest(), frame, where)
            if hasher.hexdigest() != frame.checksum:
                raise CorruptCheckpointError(
                    f"{where}: checksum mismatch on the second read (expected {frame.checksum}, got "
                    f"{hasher.hexdigest()}): the file changed in place after it was verified; the restore "
                    "failed and the live tensors read from this frame are partly overwritten"
                )

    def _staged(self, item: str) -> bool:
        return self._stage or self.destinations[item].device.type != "cpu"

    def _view(self, item: str, piece: Piece) -> memoryview:
        flat = tensor_bytes(self.destinations[item].detach().reshape(-1).view(torch.uint8))
        return flat[piece.item_offset : piece.item_offset + piece.length]

    def _stage_piece(
        self, fd: int, frame: FrameRecord, item: str, piece: Piece, hasher: xxhash.xxh3_64, where: str
    ) -> None:
        """A piece read a block at a time into the staging block, hashed, and copied into the destination."""
        staging = self._scratch.staging
        if staging is None:
            staging = self._scratch.staging = torch.empty(STAGING, dtype=torch.uint8, pin_memory=_pinned())
        flat = self.destinations[item].detach().reshape(-1).view(torch.uint8)
        view = tensor_bytes(staging)
        done = 0
        while done < piece.length:
            n = min(STAGING, piece.length - done)
            scatter_read(fd, frame.offset + piece.offset + done, [view[:n]], where)
            hasher.update(view[:n])
            at = piece.item_offset + done
            flat[at : at + n].copy_(staging[:n])  # synchronous: the block is reused at once
            done += n


def _pinned() -> bool:
    """Page-locked staging where a GPU may be the destination: copies from it run at the bus's speed."""
    return torch.cuda.is_available()
