"""Shared fixtures: runners whose tiers are real directories under the test's tmp_path."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierstate.pipeline.runner import Runner

REPO = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO / "configs" / "default.yaml"


@pytest.fixture
def make_runner(tmp_path: Path) -> Iterator[Callable[..., Runner]]:
    """Build runners from configs/default.yaml with tiers under tmp_path; all are closed afterwards."""
    runners: list[Runner] = []

    def make(yaml_path: Path = DEFAULT_YAML, **overrides: Any) -> Runner:
        settings = {
            "tiers": {"nvme": {"path": str(tmp_path / "nvme")}, "pfs": {"path": str(tmp_path / "pfs")}},
            # Every test runner checks that lazily captured tensors did not change before their copy.
            "policies.check_capture": True,
            **{key.replace("__", "."): value for key, value in overrides.items()},
        }
        runner = Runner.from_yaml(yaml_path, settings)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


@pytest.fixture
def memory_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory in /dev/shm (tmpfs: what a memory tier is) if it is usable here, else in tmp_path;
    removed afterwards."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 256 << 20:
        path = shm / f"tierstate-test-{uuid.uuid4().hex}"
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path / "memory"
