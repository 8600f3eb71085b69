"""The O_DIRECT persist path: same bytes on disk as buffered, zero padding, trimmed tail, fallbacks.

Direct writes round each frame up to 4 KiB from the slab, so these tests pin down what must not
change because of that: the file holds exactly the frame bytes at their offsets, the gaps between
frames read back as zeros (never stale slab bytes of an earlier checkpoint), the file ends at the
last frame's last byte, and anything O_DIRECT cannot take (unaligned memory, compressed frames)
still lands correctly through the buffered descriptor.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tierstate.tiers.format.container import Chunk, ChunkEntry
from tierstate.tiers.format.format import checksum, piece_body
from tierstate.tiers.format.framefile import DIRECT_ALIGN, FrameFile
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.hostcache import HostCache, Slab

SLAB = 1 << 20


def _chunk(slab: Slab, data: bytes) -> Chunk:
    slab.tensor[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return Chunk(entries=[ChunkEntry("x", 0, len(data), 0)], raw=slab.view(len(data)), slab=slab)


def _write(path: Path, chunks: list[Chunk], io: str = "auto") -> tuple[FrameFile, list]:
    writer = FrameFile(path, 4096, io)
    for chunk in chunks:
        writer.write(chunk)
    return writer, writer.finish().frames


def _payloads(n: int) -> list[bytes]:
    return [os.urandom(size) for size in (5000, 3 * DIRECT_ALIGN, 1, 70_001)[:n]]


def test_host_cache_slabs_are_aligned_for_o_direct() -> None:
    cache = HostCache(8 * SLAB, SLAB, pinned=False)
    assert all(slab.tensor.data_ptr() % DIRECT_ALIGN == 0 for slab in cache._slabs)


@pytest.mark.parametrize("io", ["auto", "buffered"])
def test_frames_land_exactly_with_zero_gaps_and_trimmed_tail(tmp_path: Path, io: str) -> None:
    cache = HostCache(8 * SLAB, SLAB, pinned=False)
    for slab in cache._slabs:
        slab.tensor.fill_(0xAB)  # stale bytes a padded direct write must not put on disk
    payloads = _payloads(4)
    writer, frames = _write(tmp_path / "f.data", [_chunk(cache._slabs[i], p) for i, p in enumerate(payloads)], io)
    data = (tmp_path / "f.data").read_bytes()
    assert len(data) == frames[-1].offset + frames[-1].length
    position = 0
    for frame, payload in zip(frames, payloads, strict=True):
        assert data[position : frame.offset] == bytes(frame.offset - position)
        assert data[frame.offset : frame.offset + frame.length] == payload
        assert frame.checksum == checksum(payload)
        position = frame.offset + frame.length
    if io == "buffered":
        assert writer.direct_frames == 0


def test_direct_is_used_where_the_file_system_allows_it(tmp_path: Path) -> None:
    _skip_without_o_direct(tmp_path)
    cache = HostCache(8 * SLAB, SLAB, pinned=False)
    writer, _ = _write(tmp_path / "f.data", [_chunk(cache._slabs[i], p) for i, p in enumerate(_payloads(3))])
    assert writer.direct_frames == 3


def test_unaligned_and_compressed_frames_go_buffered(tmp_path: Path) -> None:
    backing = torch.zeros(SLAB + 1, dtype=torch.uint8)
    start = 1 if backing.data_ptr() % DIRECT_ALIGN == 0 else 0
    unaligned = Slab(0, backing[start : start + SLAB])
    first = _chunk(unaligned, b"a" * 9000)
    aligned = HostCache(4 * SLAB, SLAB, pinned=False)._slabs[0]
    second = _chunk(aligned, b"b" * 9000)
    second.stored = b"compressed"  # pretend compress shrank it: bytes outside any slab
    writer, frames = _write(tmp_path / "f.data", [first, second])
    data = (tmp_path / "f.data").read_bytes()
    assert writer.direct_frames == 0
    assert data[frames[0].offset : frames[0].offset + frames[0].length] == b"a" * 9000
    assert data[frames[1].offset : frames[1].offset + frames[1].length] == b"compressed"


def test_a_retried_frame_keeps_its_place_and_no_padding_reaches_the_next(tmp_path: Path) -> None:
    """A write that raised goes back into the frame it reserved, even after later frames were written.

    With ``align`` below 4 KiB the next frame may start inside the 4 KiB a direct write pads to, so
    such frames go buffered: a padded retry of frame 0 would zero the start of frame 1.
    """
    _skip_without_o_direct(tmp_path)
    cache = HostCache(8 * SLAB, SLAB, pinned=False)
    first, second = _chunk(cache._slabs[0], b"a" * 5000), _chunk(cache._slabs[1], b"b" * 5000)
    writer = FrameFile(tmp_path / "f.data", 512)
    with faults.inject("persist.write", _eio), pytest.raises(OSError) as raised:
        writer.write(first)
    assert raised.value.__notes__ == ["frame 0 at offset 0"]
    assert writer.write(second) == [("x", piece_body("f.data", 1, 0, 5000, 0))]
    assert writer.write(first) == [("x", piece_body("f.data", 0, 0, 5000, 0))]  # the retry
    frames = writer.finish().frames
    assert [(f.offset, f.length) for f in frames] == [(0, 5000), (5120, 5000)]
    data = (tmp_path / "f.data").read_bytes()
    assert data == b"a" * 5000 + bytes(120) + b"b" * 5000
    assert writer.direct_frames == 0


@pytest.mark.parametrize("io", ["auto", "buffered"])
def test_the_checksum_taken_at_capture_is_the_one_stored(tmp_path: Path, io: str) -> None:
    """Capture hashes a chunk as it fills it; the writer stores that checksum without hashing again.

    So bytes changed in the slab between capture and the write (a stray write into the host cache)
    are caught when the frame is read, instead of being hashed anew and stored as if captured.
    """
    cache = HostCache(4 * SLAB, SLAB, pinned=False)
    captured = os.urandom(3 * DIRECT_ALIGN + 5)
    intact, changed = _chunk(cache._slabs[0], captured), _chunk(cache._slabs[1], captured)
    intact.raw_checksum = changed.raw_checksum = checksum(captured)
    changed.slab.tensor[100] ^= 0xFF  # after capture, before persist
    _, frames = _write(tmp_path / "f.data", [intact, changed], io)
    data = (tmp_path / "f.data").read_bytes()
    assert frames[0].checksum == frames[1].checksum == checksum(captured)
    assert checksum(data[frames[0].offset : frames[0].offset + frames[0].length]) == frames[0].checksum
    assert checksum(data[frames[1].offset : frames[1].offset + frames[1].length]) != frames[1].checksum


def test_a_compressed_frame_is_hashed_as_stored(tmp_path: Path) -> None:
    """The capture checksum is of the raw bytes; a frame stored compressed gets the checksum of what it stores."""
    slab = HostCache(4 * SLAB, SLAB, pinned=False)._slabs[0]
    chunk = _chunk(slab, b"c" * 9000)
    chunk.raw_checksum = checksum(b"c" * 9000)
    chunk.stored = b"compressed"
    _, frames = _write(tmp_path / "f.data", [chunk])
    assert frames[0].checksum == checksum(b"compressed")


def _eio(_path: Path | None) -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def _skip_without_o_direct(directory: Path) -> None:
    probe = directory / "probe"
    probe.touch()
    try:
        os.close(os.open(probe, os.O_WRONLY | getattr(os, "O_DIRECT", 0)))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
