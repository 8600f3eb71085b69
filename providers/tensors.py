"""A dict of named tensors as a provider: the smallest useful one, for states that are not modules.

Restored in place, byte for byte: element copies are not implemented for some dtypes on the CPU
(the sub-byte and bit types, float8), and a byte copy is exact for every dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import require_keys
from .items import TensorItem


class TensorDictProvider:
    """``{name: tensor}``, each tensor described by reference under its name and restored in place."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def describe(self) -> list[TensorItem]:
        return [TensorItem(key, t) for key, t in self.tensors.items()]

    def restore(self, state: Mapping[str, Any]) -> None:
        require_keys("TensorDictProvider", state, set(self.tensors))
        for key, t in self.tensors.items():
            t.reshape(-1).view(torch.uint8).copy_(state[key].reshape(-1).view(torch.uint8))
