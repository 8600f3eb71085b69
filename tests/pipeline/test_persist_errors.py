"""Storage errors on the persist path are handled the same in both container formats.

Whichever container ``persist.format`` picks, a chunk write that fails transiently is retried under
``persist.retries``/``backoff`` and the checkpoint commits bit-exactly; one that keeps failing, or a
failed fsync (never retried), fails the checkpoint with a TierError naming the tier and the file;
the committed checkpoints stay and the next checkpoint works. The write faults are raised at the
``persist.write`` fault point (a transient EIO cannot be had from the kernel on demand); a data file
that cannot be created is a symlink planted under its name, refused (never written through).
"""

from __future__ import annotations

import errno
import logging
import os
from itertools import pairwise
from pathlib import Path

import h5py
import pytest
import torch

from tierstate.pipeline.runner import Runner
from tierstate.providers import ObjectProvider, TensorDictProvider
from tierstate.tiers.format.container import Chunk, ChunkEntry, Layout, TensorLayout
from tierstate.tiers.format.hdf5 import Hdf5Container
from tierstate.tiers.ops.verify import verify_step
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import TierError

FORMATS = [("frames", "rank-00000.data"), ("hdf5", "rank-00000.h5")]


def _runner(make_runner, fmt: str, retries: int) -> tuple[Runner, dict[str, torch.Tensor]]:
    """A runner writing ``fmt`` with one buffered persist worker (so faults hit one write after another)."""
    persist = {"format": fmt, "workers": 1, "io": "buffered", "retries": retries, "backoff": 0.01}
    runner = make_runner(chunk_size="1MiB", **{f"pipeline__stages__persist__{k}": v for k, v in persist.items()})
    tensors = {"w": torch.randn(3 << 18, generator=torch.Generator().manual_seed(0)), "b": torch.arange(10.0)}
    runner.register(t=TensorDictProvider(tensors), meta=ObjectProvider({"epoch": 3}))
    return runner, tensors


def _eio(_path: Path | None) -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def _failed(runner: Runner, step: int) -> TierError:
    """Checkpoint ``step``, which must fail with a TierError; the earlier ones stay, the partial is gone."""
    handle = runner.checkpoint(step)
    assert handle.wait(60) and isinstance(handle.error, TierError), handle.error
    assert runner.durable_tier.steps() == list(range(1, step)) and runner.durable_tier.partials() == []
    assert runner.cache.in_use == 0
    return handle.error


@pytest.mark.parametrize("fmt, data_file", FORMATS)
def test_transient_write_errors_are_retried_in_either_format(make_runner, caplog, fmt: str, data_file: str) -> None:
    runner, tensors = _runner(make_runner, fmt, retries=3)
    expected = {k: v.clone() for k, v in tensors.items()}
    raised: list[int] = []

    def three_times(path: Path | None) -> None:
        if len(raised) < 3:
            raised.append(1)
            _eio(path)

    caplog.set_level(logging.WARNING, logger="tierstate")
    with faults.inject("persist.write", three_times):
        result = runner.checkpoint(1).result()
    retries = [line for line in caplog.text.splitlines() if "retry" in line]
    assert [line.split("; ")[-1] for line in retries] == [
        "retry 1 of 3 in 0.01 s",
        "retry 2 of 3 in 0.02 s",
        "retry 3 of 3 in 0.04 s",
    ]
    partial = runner.durable_tier.partial_dir(1)
    assert all(f"tier nvme: writing {partial / data_file} frame " in line for line in retries), retries
    assert (result.path / data_file).is_file() and verify_step(runner.durable_tier, 1).ok
    for tensor in tensors.values():
        tensor.zero_()
    runner.restore(1)
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())


@pytest.mark.parametrize("fmt, data_file", FORMATS)
def test_a_write_that_keeps_failing_names_the_tier_and_the_file(make_runner, fmt: str, data_file: str) -> None:
    runner, _ = _runner(make_runner, fmt, retries=2)
    runner.checkpoint(1).result()
    with faults.inject("persist.write", _eio):
        error = _failed(runner, 2)
    partial = runner.durable_tier.partial_dir(2)
    assert error.errno == errno.EIO
    assert str(error).startswith(f"[Errno 5] tier nvme: writing {partial / data_file} frame "), error
    assert str(error).endswith("Input/output error (after 2 retries)"), error
    assert runner.checkpoint(3).result().step == 3  # training goes on


@pytest.mark.parametrize("fmt, data_file", FORMATS)
def test_a_failed_fsync_is_named_and_never_retried(make_runner, fmt: str, data_file: str) -> None:
    runner, _ = _runner(make_runner, fmt, retries=2)
    runner.checkpoint(1).result()
    calls: list[Path | None] = []

    def fail(path: Path | None) -> None:
        calls.append(path)
        _eio(path)

    with faults.inject("persist.fsync", fail):
        error = _failed(runner, 2)
    partial = runner.durable_tier.partial_dir(2)
    assert calls == [partial / data_file]
    assert str(error) == f"[Errno 5] tier nvme: fsync of {partial / data_file}: Input/output error"
    assert runner.checkpoint(3).result().step == 3


@pytest.mark.parametrize("fmt, data_file", FORMATS)
def test_a_data_file_planted_in_the_partial_is_refused_naming_the_tier_and_the_file(
    make_runner, tmp_path: Path, fmt: str, data_file: str
) -> None:
    """A symlink put where the data file goes is never written through: the file is created new."""
    runner, _ = _runner(make_runner, fmt, retries=1)
    runner.checkpoint(1).result()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not tierstate's")
    with faults.inject("begin", lambda partial: os.symlink(elsewhere, partial / data_file)):
        error = _failed(runner, 2)
    assert error.errno == errno.EEXIST and "tier nvme: " in str(error), error
    assert f"{runner.durable_tier.partial_dir(2) / data_file}: already exists (a symlink)" in str(error), error
    assert elsewhere.read_bytes() == b"not tierstate's"
    assert runner.checkpoint(3).result().step == 3


def test_an_hdf5_chunk_written_again_after_failing_midway_holds_each_frame_once(tmp_path: Path) -> None:
    """A retry rewrites the entries that had already landed into their own frames, not new ones."""
    values = {key: torch.full((256,), float(i)) for i, key in enumerate("abc")}
    container = Hdf5Container(tmp_path / "r.h5", 4096, {}, Layout({k: TensorLayout("float32", [256]) for k in values}))
    raw = memoryview(b"".join(v.numpy().tobytes() for v in values.values()))
    chunk = Chunk([ChunkEntry(key, 0, 1024, 1024 * i) for i, key in enumerate(values)], raw)
    hits: list[int] = []

    def second_write_fails(path: Path | None) -> None:
        hits.append(1)
        if len(hits) == 2:
            _eio(path)

    with faults.inject("persist.write", second_write_fails), pytest.raises(OSError):
        container.write(chunk)
    pieces = container.write(chunk)
    file = container.finish()
    assert [(key, piece["frame"]) for key, piece in pieces] == [("a", 0), ("b", 1), ("c", 2)]
    ends = [(f.offset, f.offset + f.length) for f in sorted(file.frames, key=lambda f: f.offset)]
    assert all(end <= start for (_, end), (start, _) in pairwise(ends)), "frames overlap"
    with h5py.File(tmp_path / "r.h5", "r") as f:
        assert all(torch.equal(torch.from_numpy(f[key][()]), value) for key, value in values.items())
