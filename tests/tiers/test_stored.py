"""One object per stored checkpoint, read through the byte-source protocol.

A source that is no directory (objects held in a dict, as a bucket would hold them) is read by the
same code as a directory and gives the same values; its damage is caught by the same checksums.
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest
import torch

from tierstate.providers import ObjectProvider, TensorDictProvider
from tierstate.tiers.format.format import ManifestError
from tierstate.tiers.reading.source import ByteSource, DirectorySource, ShortReadError
from tierstate.tiers.reading.stored import CorruptCheckpointError, StoredCheckpoint


class DictSource:
    """Objects in memory: a real, complete implementation of the protocol (what a bucket prefix offers)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    @property
    def where(self) -> str:
        return "mem://checkpoint"

    def names(self) -> list[str]:
        return list(self.objects)

    def size(self, name: str) -> int:
        if name not in self.objects:
            raise FileNotFoundError(errno.ENOENT, f"{self.where}/{name}: no such object")
        return len(self.objects[name])

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        data = self.objects[name][offset : offset + len(buffer)]
        if len(data) < len(buffer):
            raise ShortReadError(errno.EIO, f"{self.where}/{name}: short read")
        buffer[:] = data

    def read_small(self, name: str) -> bytes:
        if name not in self.objects:
            raise FileNotFoundError(errno.ENOENT, f"{self.where}/{name}: no such object")
        return self.objects[name]

    @property
    def local_directory(self) -> None:
        return None  # no files: read a frame at a time through read_into

    def reading(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # objects in memory: nothing deletes them mid-read


def _saved(make_runner) -> Path:
    runner = make_runner()
    weights = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b": torch.ones(7)}
    weights["tied"] = weights["w"]
    runner.register(model=TensorDictProvider(weights), meta=ObjectProvider({"epoch": 3}))
    return runner.checkpoint(5).result().path


def _flip_a_byte_of_frame_0(source: DictSource) -> str:
    """Damage one byte inside the first frame of the data file (not its padding); the file's name."""
    data_file = next(name for name in source.names() if name.endswith(".data"))
    frame = StoredCheckpoint(source).manifest.files[data_file].frames[0]
    raw = bytearray(source.objects[data_file])
    raw[frame.offset + frame.length // 2] ^= 0xFF
    source.objects[data_file] = bytes(raw)
    return data_file


def _in_memory(directory: Path) -> DictSource:
    source = DirectorySource(directory)
    return DictSource({name: source.read_small(name) for name in source.names()})


def test_a_source_that_is_no_directory_reads_the_same_values(make_runner) -> None:
    directory = _saved(make_runner)
    source = _in_memory(directory)
    assert isinstance(source, ByteSource)
    from_dir = StoredCheckpoint(directory, step=5).read()
    from_mem = StoredCheckpoint(source, step=5).read()
    assert from_dir.keys() == from_mem.keys()
    for key, value in from_dir.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, from_mem[key]), key
        else:
            assert value == from_mem[key], key
    assert from_mem["model/tied"] is from_mem["model/w"]  # a tied tensor is its target's
    assert StoredCheckpoint(source).providers() == ["meta", "model"]


def test_a_flipped_byte_in_a_source_object_is_a_checksum_error_naming_it(make_runner) -> None:
    source = _in_memory(_saved(make_runner))
    data_file = _flip_a_byte_of_frame_0(source)
    with pytest.raises(CorruptCheckpointError, match=f"mem://checkpoint/{data_file} frame 0: checksum mismatch"):
        StoredCheckpoint(source).read()


def test_a_truncated_source_object_is_refused_before_reading(make_runner) -> None:
    source = _in_memory(_saved(make_runner))
    data_file = next(name for name in source.names() if name.endswith(".data"))
    source.objects[data_file] = source.objects[data_file][:100]
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        StoredCheckpoint(source).read()
    assert issubclass(CorruptCheckpointError, StoredCheckpoint.COPY_ERRORS)


def test_a_manifest_for_another_step_is_refused(make_runner) -> None:
    directory = _saved(make_runner)
    with pytest.raises(ManifestError, match="manifest is for step 5, not step 6"):
        StoredCheckpoint(directory, step=6)
    with pytest.raises(ManifestError, match="no manifest"):
        StoredCheckpoint(DictSource({}))


def test_locked_holds_the_read_lock_on_a_directory(make_runner) -> None:
    from tierstate.tiers.storage.locks import InUseError, exclusive

    directory = _saved(make_runner)
    with StoredCheckpoint.locked(directory, 5) as checkpoint:
        assert checkpoint.directory == directory
        with pytest.raises(InUseError), exclusive(directory):
            pass


def test_verify_names_the_bad_frame_in_a_directory_and_in_another_source_alike(make_runner) -> None:
    directory = _saved(make_runner)
    assert StoredCheckpoint(directory).verify() == []
    source = _in_memory(directory)
    assert StoredCheckpoint(source).verify() == []
    data_file = _flip_a_byte_of_frame_0(source)
    (problem,) = StoredCheckpoint(source).verify()
    assert (problem.file, problem.frame) == (data_file, 0) and "checksum mismatch" in problem.message
    (directory / data_file).write_bytes(source.objects[data_file])
    assert [str(p) for p in StoredCheckpoint(directory).verify()] == [str(problem)]
