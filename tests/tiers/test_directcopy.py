"""Raw frames copied with O_DIRECT (tiers/ops/directcopy.py), on real files: the bytes arrive whole, the
unaligned tail too; a source that does not match its checksum fails the copy; a frame with a hole, a
compressed one or a misaligned one is left to the buffered path, which verifies it before writing; a
migration through it is bit-exact and resumable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierstate import Runner, TensorDictProvider
from tierstate.tiers.format.format import checksum
from tierstate.tiers.format.framefile import DIRECT_ALIGN
from tierstate.tiers.format.records import FrameRecord
from tierstate.tiers.ops.directcopy import DirectFrames
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.reading.reader import CorruptCheckpointError
from tierstate.tiers.reading.stored import StoredCheckpoint
from tierstate.tiers.storage.filesystem import FilesystemTier

MiB = 1 << 20


def _files(tmp_path: Path, data: bytes, size: int) -> tuple[int, int, Path]:
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_bytes(data)
    dst = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(dst, size)
    return os.open(source, os.O_RDONLY), dst, target


def _takes_direct(directory: Path) -> bool:
    """Whether files in ``directory`` open with O_DIRECT."""
    try:
        os.close(os.open(directory / "probe", os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644))
    except OSError:
        return False
    finally:
        (directory / "probe").unlink(missing_ok=True)
    return hasattr(os, "O_DIRECT")


def _direct_or_skip(dst: int, target: Path) -> DirectFrames:
    if not _takes_direct(target.parent):
        pytest.skip(f"{target.parent}: no O_DIRECT on this file system")
    return DirectFrames(dst, target)


@pytest.mark.parametrize("length", [3 * DIRECT_ALIGN, 9 * MiB + 123, 17])  # whole pages, blocks + a tail, tail only
def test_a_raw_frame_arrives_whole_and_is_read_back_from_the_device(tmp_path: Path, length: int) -> None:
    offset = 2 * DIRECT_ALIGN
    data = bytes(offset) + os.urandom(length)
    src, dst, target = _files(tmp_path, data, len(data))
    frame = FrameRecord(offset=offset, length=length, raw_length=length, codec="none", checksum=checksum(data[offset:]))
    direct = _direct_or_skip(dst, target)
    try:
        assert direct.takes(src, frame)
        assert direct.copy(src, frame, "source frame 0") == frame.checksum
    finally:
        direct.close()
        os.close(src)
        os.close(dst)
    assert target.read_bytes() == data  # the bytes before the frame stayed a hole: zeros, as in the source


def test_a_source_that_does_not_match_its_checksum_fails_the_copy(tmp_path: Path) -> None:
    data = os.urandom(MiB)
    src, dst, target = _files(tmp_path, data, len(data))
    frame = FrameRecord(offset=0, length=MiB, raw_length=MiB, codec="none", checksum=checksum(data[:-1] + b"\0"))
    direct = _direct_or_skip(dst, target)
    try:
        with pytest.raises(CorruptCheckpointError, match=r"^source frame 0: bytes 0\.\.1048576: checksum mismatch"):
            direct.copy(src, frame, "source frame 0")
    finally:
        direct.close()
        os.close(src)
        os.close(dst)


def test_holes_compressed_and_misaligned_frames_are_left_to_the_verifying_path(tmp_path: Path) -> None:
    data = os.urandom(4 * DIRECT_ALIGN)
    src, dst, target = _files(tmp_path, data, 64 * MiB)
    os.truncate(tmp_path / "source", 64 * MiB)  # a sparse tail: claimed, never written
    digest = checksum(data)
    direct = _direct_or_skip(dst, target)
    try:
        assert direct.takes(src, FrameRecord(offset=0, length=len(data), raw_length=len(data), codec="none",
                                             checksum=digest))  # fmt: skip
        assert not direct.takes(src, FrameRecord(offset=0, length=64 * MiB, raw_length=64 * MiB, codec="none",
                                                 checksum=digest))  # fmt: skip
        assert not direct.takes(src, FrameRecord(offset=0, length=len(data), raw_length=9 * len(data), codec="zstd",
                                                 checksum=digest))  # fmt: skip
        assert not direct.takes(src, FrameRecord(offset=512, length=len(data) - 512, raw_length=len(data) - 512,
                                                 codec="none", checksum=digest))  # fmt: skip
    finally:
        direct.close()
        os.close(src)
        os.close(dst)


def test_a_memory_tier_step_migrates_through_it_bit_exact(tmp_path: Path, memory_dir: Path) -> None:
    state = {"w": torch.randn(3 * MiB + 5), "b": torch.arange(1000, dtype=torch.int64)}
    layout = {"tiers": {"memory": {"kind": "memory", "path": str(memory_dir), "size": "64MiB",
                                   "retention": {"keep_last": 2}}},
              "chunk_size": "4MiB", "host_cache": {"size": "16MiB"}}  # fmt: skip
    with Runner.from_dict(layout) as runner:
        runner.register(model=TensorDictProvider(state))
        runner.checkpoint(1).result()
    memory, nvme = FilesystemTier("memory", memory_dir), FilesystemTier("nvme", tmp_path / "nvme")
    first = migrate(1, memory, nvme)
    assert first.frames_copied == first.frames > 0
    if _takes_direct(tmp_path):
        assert first.frames_direct == first.frames  # the tensor frames and the objects' (raw, 4 KiB-aligned)
    read = StoredCheckpoint(nvme.step_dir(1), 1).read()
    assert torch.equal(read["model/w"], state["w"]) and torch.equal(read["model/b"], state["b"])
    again = migrate(1, memory, nvme)
    assert again.outcome == "already there" and again.frames_copied == 0
