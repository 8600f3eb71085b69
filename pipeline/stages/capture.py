"""The capture stage: tensor bytes copied into host-cache slabs, the only step the trainer may wait for.

Host tensors are copied by a worker thread (``copy_`` releases the GIL). GPU tensors are copied on
a side CUDA stream, into pinned slabs, with ``non_blocking=True``; the side stream first waits for
an event recorded on the trainer's stream when the checkpoint was requested (so it copies the
values of that moment, after any pending optimizer kernels), and completion is an event the worker
thread synchronizes on, never the trainer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import numpy as np
import torch
import xxhash

from ...tiers.storage import faults
from ...tiers.storage.hostcache import Slab
from ..units import Chunk, ChunkEntry, ChunkPlan, CopyProgram, EagerSources, TensorPiece, Unit


def record_ready_event(tensors: list[torch.Tensor]) -> torch.cuda.Event | None:
    """An event on the current CUDA stream if any tensor lives on a GPU, else None."""
    if not any(t.is_cuda for t in tensors):
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class SlabSource(Protocol):
    """Where capture copies a chunk: a host-cache slab (stages/slabs.py), or its window of a memory tier's slot
    (pipeline/slotjob.py), which is its place in the data file itself."""

    def take(self, plan: ChunkPlan) -> Slab: ...


class Capture:
    """The stage: each :class:`ChunkPlan` into a slab of its own, as a :class:`Chunk`. The object batch needs
    nothing (its values were snapshotted at the request) and goes on as it is. Once the last of this
    rank's ``chunks`` is copied, ``on_captured`` runs (the optimizer may step from then on)."""

    def __init__(
        self,
        slabs: SlabSource,
        copier: SlabCopier,
        ready: torch.cuda.Event | None,
        sources: EagerSources | None,
        hash_raw: bool,
        chunks: int,
        on_captured: Callable[[], None],
        lock: threading.Lock,
    ) -> None:
        self._slabs = slabs
        self._copier = copier
        self._ready = ready
        self._sources = sources
        self._hash_raw = hash_raw
        self._left = chunks
        self._on_captured = on_captured
        self._lock = lock

    def passes(self, unit: Unit) -> bool:  # noqa: ARG002  # every unit is counted as captured, objects too
        return False

    def run(self, unit: Unit) -> Unit:
        if not isinstance(unit, ChunkPlan):
            return unit
        chunk = self._copier.copy(unit, self._slabs.take(unit), self._ready, self._sources, self._hash_raw)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._on_captured()
        return chunk


# The one empty ``where`` of a capture without eager sources: a program is kept while its ``where`` is the same
# object, so a fresh ``{}`` per call would work the program (and the pieces' views) out again every checkpoint.
_NOWHERE: Mapping[str, tuple[int, int]] = MappingProxyType({})


class SlabCopier:
    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def copy(
        self,
        plan: ChunkPlan,
        slab: Slab,
        ready: torch.cuda.Event | None,
        sources: EagerSources | None = None,
        hash_raw: bool = True,
    ) -> Chunk:
        """Copy every piece of ``plan`` into ``slab``; returns when the bytes are in host memory.

        ``sources``: where the items copied in batches on the trainer's thread have their bytes (plan_cache.py).
        ``hash_raw``: checksum the chunk now (False when compression will store other bytes anyway); a
        chunk holding a GPU's bytes is never checksummed here (see below), persist does it.
        """
        where = sources.where if sources is not None else _NOWHERE
        program = plan.program
        if program is None or program.where is not where:  # worked out once per chunk of a reused plan
            program = plan.program = copy_program(plan, where)
        dst = slab.tensor
        dst_bytes = dst.numpy()  # once per chunk: a chunk may hold thousands of small tensors
        for start, end in program.zeros:
            dst_bytes[start:end] = 0  # alignment padding: no stale bytes on disk
        # Host bytes are hashed here, by the thread that copied them, a block behind the copy while that block
        # is still in cache: persist then only writes (one busy thread per chunk, not two), and the checksum
        # covers the bytes as captured, so a slab changed between capture and write fails verification.
        # Bytes from a GPU are not: the DMA copy runs at ~55 GB/s and xxh3 on one core at ~7, so hashing here
        # made capture, which the optimizer's next step waits for, 4.4x slower (measured on an H200); persist
        # hashes them before writing.
        trail = Trail(dst_bytes) if hash_raw and not program.on_gpu else None
        views = program.views if program.runs_before else None  # kept from a program's second run on
        gpu_pieces = []
        for is_piece, index in program.order:
            if not is_piece:
                if sources is not None:
                    group, src, at, length = program.runs[index]
                    _copy_bytes(dst_bytes, at, sources.stacks[group][src : src + length], trail)
                continue
            piece = program.pieces[index]
            if program.on_gpu and piece.item.tensor.is_cuda:
                gpu_pieces.append(piece)
            else:
                _copy_host_piece(piece, dst, dst_bytes, views, index, trail)
        program.runs_before += 1
        if gpu_pieces:
            self._copy_from_gpu(gpu_pieces, dst, ready)
        faults.point("capture")
        return Chunk(
            entries=program.entries,
            raw=slab.view(plan.nbytes),
            slab=slab,
            element_size=program.element_size,
            raw_checksum=trail.digest(plan.nbytes) if trail is not None else None,
        )

    def _copy_from_gpu(self, pieces: list[TensorPiece], dst: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        done = []
        for device in {p.item.tensor.device for p in pieces}:
            stream = self._side_stream(device)
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                for piece in pieces:
                    if piece.item.tensor.device == device:
                        _copy_piece(piece, dst, non_blocking=True)
                        # The caching allocator must not reuse the source before the side stream reads it.
                        piece.item.tensor.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
                done.append(event)
        for event in done:
            event.synchronize()


class Trail:
    """The checksum of a chunk's bytes, taken in order a block behind capture's copies: each block is hashed while
    it is still in cache, not in a second pass over the whole chunk from memory. Measured on the 2-core VM
    (320 MB in 64 MiB chunks, CPU time): the copy alone 50 ms, copy then xxh3 of each chunk 71.5 ms, xxh3
    trailing 256 KiB behind 65 ms (64 KiB: 67.5, 1 MiB: 69.7)."""

    BLOCK = 256 << 10

    def __init__(self, data: np.ndarray) -> None:
        self._data = data.data  # its bytes (uint8) as a memoryview, what xxhash takes
        self._hasher = xxhash.xxh3_64()
        self._done = 0

    def upto(self, end: int) -> None:
        """Every byte before ``end`` is in place: hash them once a block's worth is waiting."""
        if end - self._done >= self.BLOCK:
            self._hasher.update(self._data[self._done : end])
            self._done = end

    def digest(self, end: int) -> str:
        """The checksum of the first ``end`` bytes (all in place), as :func:`tiers.format.format.checksum` gives it."""
        self._hasher.update(self._data[self._done : end])
        return self._hasher.hexdigest()


def _copy_bytes(dst_bytes: np.ndarray, at: int, source: np.ndarray, trail: Trail | None) -> None:
    """``source`` (bytes) into ``dst_bytes`` at ``at``; with ``trail``, a block at a time, each hashed behind."""
    length = len(source)
    if trail is None or length <= Trail.BLOCK:
        dst_bytes[at : at + length] = source  # the same memcpy as np.copyto, half its call overhead
        if trail is not None:
            trail.upto(at + length)
        return
    for start in range(0, length, Trail.BLOCK):
        stop = min(start + Trail.BLOCK, length)
        dst_bytes[at + start : at + stop] = source[start:stop]
        trail.upto(at + stop)


def copy_program(plan: ChunkPlan, where: Mapping[str, tuple[int, int]]) -> CopyProgram:
    """How capture copies ``plan``'s pieces: out of the eager stacks ``where`` says, else from their tensors."""
    zeros: list[tuple[int, int]] = []
    runs: list[tuple[int, int, int, int]] = []
    pieces: list[TensorPiece] = []
    order: list[tuple[bool, int]] = []
    end = 0
    for piece in plan.pieces:  # in the order of their bytes in the chunk (plan.py packs them so)
        if piece.chunk_offset > end:
            zeros.append((end, piece.chunk_offset))
        end = piece.chunk_offset + piece.length
        place = where.get(piece.item.key)
        if place is None:
            order.append((True, len(pieces)))
            pieces.append(piece)
            continue
        group, src = place[0], place[1] + piece.item_offset
        last = runs[-1] if runs and order[-1] == (False, len(runs) - 1) else None
        if last is not None and (last[0], last[1] + last[3], last[2] + last[3]) == (group, src, piece.chunk_offset):
            runs[-1] = (group, last[1], last[2], last[3] + piece.length)
        else:
            order.append((False, len(runs)))
            runs.append((group, src, piece.chunk_offset, piece.length))
    entries = [ChunkEntry(p.item.key, p.item_offset, p.length, p.chunk_offset) for p in plan.pieces]
    on_gpu = any(p.item.tensor.is_cuda for p in pieces)
    return CopyProgram(
        where, entries, zeros, runs, pieces, _dominant_element_size(plan), order, on_gpu, [None] * len(pieces)
    )


def _dominant_element_size(plan: ChunkPlan) -> int:
    """The element size holding most of the chunk's bytes: the shuffle width that helps most."""
    by_size: dict[int, int] = {}
    for piece in plan.pieces:
        size = piece.item.tensor.element_size()
        by_size[size] = by_size.get(size, 0) + piece.length
    return max(by_size, key=by_size.__getitem__)


def _copy_host_piece(
    piece: TensorPiece,
    dst: torch.Tensor,
    dst_bytes: np.ndarray,
    views: list[tuple[int, np.ndarray] | None] | None,
    index: int,
    trail: Trail | None,
) -> None:
    src = piece.item.tensor
    if not src.is_contiguous():
        _copy_piece(piece, dst, non_blocking=False)
        if trail is not None:
            trail.upto(piece.chunk_offset + piece.length)
        return
    # Bytes, not elements: works for every dtype (sub-byte, float8, bits) and is a plain memcpy.
    # numpy's copy is one thread and drops the GIL; torch's copy_ would start an OpenMP team from
    # this background thread, whose threads spin and contend with the trainer's own on a busy CPU.
    # Slicing numpy arrays rather than tensors: ~3 us less per piece (10^4 small tensors: 30 ms).
    address = src.data_ptr()
    view = views[index] if views is not None else None
    if view is None or view[0] != address:  # not kept, first time, or the tensor was given other memory
        source = src.detach().reshape(-1).view(torch.uint8).numpy()
        view = (address, source[piece.item_offset : piece.item_offset + piece.length])
        if views is not None:
            views[index] = view
    _copy_bytes(dst_bytes, piece.chunk_offset, view[1], trail)


def _copy_piece(piece: TensorPiece, dst: torch.Tensor, non_blocking: bool) -> None:
    src = piece.item.tensor.detach()  # a reused plan holds parameters themselves: no autograd for the copy
    window = dst[piece.chunk_offset : piece.chunk_offset + piece.length]
    if src.is_contiguous():
        source_bytes = src.reshape(-1).view(torch.uint8)[piece.item_offset : piece.item_offset + piece.length]
        window.copy_(source_bytes, non_blocking=non_blocking)
    elif piece.length == piece.item.nbytes:
        # A whole strided view: one strided copy straight into the slab, no temporary.
        window.view(src.dtype).view(src.shape).copy_(src, non_blocking=non_blocking)
    else:
        # A strided view larger than a chunk: made contiguous once per piece (rare; costs a temporary).
        flat = src.contiguous().reshape(-1).view(torch.uint8)
        window.copy_(flat[piece.item_offset : piece.item_offset + piece.length], non_blocking=non_blocking)
