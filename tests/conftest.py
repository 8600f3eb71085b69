"""Shared fixtures: runners whose tiers are real directories under the test's tmp_path."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.runner import Runner
from providers.items import TensorItem

REPO = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO / "configs" / "default.yaml"


class TensorDictProvider:
    """A user-written provider (the README's example): a dict of named tensors, restored in place."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def describe(self) -> list[TensorItem]:
        return [TensorItem(key, t) for key, t in self.tensors.items()]

    def restore(self, state: Mapping[str, Any]) -> None:
        for key, t in self.tensors.items():
            # Byte copies: element copies are not implemented for some dtypes (int1, float8 on CPU).
            t.reshape(-1).view(torch.uint8).copy_(state[key].reshape(-1).view(torch.uint8))


@pytest.fixture
def make_runner(tmp_path: Path) -> Iterator[Callable[..., Runner]]:
    """Build runners from configs/default.yaml with tiers under tmp_path; all are closed afterwards."""
    runners: list[Runner] = []

    def make(yaml_path: Path = DEFAULT_YAML, **overrides: Any) -> Runner:
        settings = {
            "tiers": {"nvme": {"path": str(tmp_path / "nvme")}, "pfs": {"path": str(tmp_path / "pfs")}},
            **{key.replace("__", "."): value for key, value in overrides.items()},
        }
        runner = Runner.from_yaml(yaml_path, settings)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()
