"""Mistakes fail at once, naming what is wrong, instead of hours later as a log line: tier paths when
the runner is built, an empty registration, a wrong step and a wrong attach when they are made."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tierstate import TierstateError
from tierstate.pipeline.laziness import AttachError
from tierstate.pipeline.request import InvalidStepError, NothingRegisteredError
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.storage.filesystem import TierError

# --- tier paths, when the runner is built -------------------------------------------------------


def _build(make_runner: Callable[..., Runner], nvme: Path, path: Path | None = None, **pfs: object) -> Runner:
    """A runner persisting to ``nvme``; its pfs tier (``path``, default beside nvme) takes ``pfs`` settings."""
    pfs_path = nvme.parent / "pfs" if path is None else path
    return make_runner(tiers={"nvme": {"path": str(nvme)}, "pfs": {"path": str(pfs_path), **pfs}})


def test_a_tier_path_that_is_a_file_fails_the_build(make_runner: Callable[..., Runner], tmp_path: Path) -> None:
    blocker = tmp_path / "nvme"
    blocker.write_text("a file where the tier should be")
    with pytest.raises(TierError, match=rf"tier nvme: {blocker} is not a directory") as failure:
        _build(make_runner, blocker)
    assert failure.value.errno == errno.ENOTDIR
    with pytest.raises(TierError, match=rf"tier nvme: {blocker / 'run'} is not a directory \(under {blocker}, which"):
        _build(make_runner, blocker / "run")


def test_missing_tier_directories_are_created_when_the_runner_is_built(
    make_runner: Callable[..., Runner], tmp_path: Path
) -> None:
    nvme = tmp_path / "scratch" / "run7" / "nvme"
    _build(make_runner, nvme, path=tmp_path / "archive" / "pfs")
    assert nvme.is_dir() and os.listdir(nvme) == []  # no probe file left behind
    assert not (tmp_path / "archive").exists()  # only read (no flush, no retention): not created


def test_a_missing_top_level_directory_is_not_created(make_runner: Callable[..., Runner], tmp_path: Path) -> None:
    top = Path("/") / f"tierstate-absent-{os.getpid()}"
    assert not top.exists()
    with pytest.raises(TierError, match=rf"tier nvme: {top}/run7 cannot be created: {top} does not exist"):
        _build(make_runner, top / "run7", path=tmp_path / "pfs")
    assert not top.exists()  # an unmounted /lustre is not replaced by a directory on the root disk


def _read_only_directory(tmp_path: Path) -> Path:
    """A directory that refuses new files: by its mode for a normal user; for root (whom modes do not
    stop) sysfs, which no one may create files in."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        return locked
    try:
        os.close(tempfile.mkstemp(dir="/sys/kernel")[0])
    except OSError:
        return Path("/sys/kernel")
    pytest.skip("no read-only directory available here")


def test_a_tier_that_is_not_writable_fails_the_build(make_runner: Callable[..., Runner], tmp_path: Path) -> None:
    locked = _read_only_directory(tmp_path)
    with pytest.raises(TierError, match=rf"tier nvme: {locked} is not writable: ") as failure:
        _build(make_runner, locked)
    assert failure.value.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    with pytest.raises(TierError, match=rf"tier nvme: {locked / 'nvme'} cannot be created: "):
        _build(make_runner, locked / "nvme")


def test_a_tier_only_read_from_may_be_read_only_but_not_a_file(
    make_runner: Callable[..., Runner], tmp_path: Path
) -> None:
    locked = _read_only_directory(tmp_path)
    _build(make_runner, tmp_path / "nvme", path=locked)  # restore from a read-only archive: fine
    with pytest.raises(TierError, match=rf"tier pfs: {locked} is not writable"):
        _build(make_runner, tmp_path / "nvme", path=locked, flush={})  # flushes write it
    blocker = tmp_path / "a-file"
    blocker.write_text("not a tier")
    with pytest.raises(TierError, match=rf"tier pfs: {blocker} is not a directory"):
        _build(make_runner, tmp_path / "nvme", path=blocker)


# --- checkpoint(), register(), attach() -----------------------------------------------------------


def test_a_checkpoint_with_nothing_registered_raises_and_writes_nothing(
    make_runner: Callable[..., Runner], tmp_path: Path
) -> None:
    runner = make_runner()
    with pytest.raises(NothingRegisteredError, match=r"checkpoint step 1: nothing is registered; call runner.register"):
        runner.checkpoint(1)
    assert os.listdir(tmp_path / "nvme") == [] and runner.metrics().requested == 0
    runner.register(t=TensorDictProvider({"w": torch.ones(4)}))
    assert runner.checkpoint(1).result().step == 1  # the runner is unharmed


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (-1, r"checkpoint step must be from 0 to 2\*\*50, got -1"),
        (2**50 + 1, r"checkpoint step must be from 0 to 2\*\*50, got 1125899906842625"),
        (torch.tensor(5), r"checkpoint step must be an int, got a tensor \(tensor\(5\)\); pass int\(step\)"),
        (1.5, r"checkpoint step must be an int from 0 to 2\*\*50, got float 1.5"),
        (True, r"got bool True"),
        ("3", r"got str '3'"),
    ],
)
def test_a_wrong_step_gets_our_own_message(make_runner: Callable[..., Runner], step: object, message: str) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": torch.ones(4)}))
    with pytest.raises(InvalidStepError, match=message) as failure:
        runner.checkpoint(step)  # type: ignore[arg-type]
    assert isinstance(failure.value, ValueError) and isinstance(failure.value, TierstateError)
    assert "pydantic" not in str(failure.value) and "http" not in str(failure.value)
    assert runner.checkpoint(np.int64(7)).result().step == 7  # any integer type will do; nothing was left in flight


def test_attach_says_an_optimizer_is_expected(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner()
    model = torch.nn.Linear(2, 2)
    expected = r"attach\(\) expects a torch.optim.Optimizer .*got Linear; register the model with register\(model="
    with pytest.raises(AttachError, match=expected):
        runner.attach(model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got dict$"):
        runner.attach({"lr": 0.1})  # type: ignore[arg-type]
    assert runner.attached == ()
