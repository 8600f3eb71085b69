"""A synthetic state, ``{name: tensor}``, of any size and shape, saved through the library's
``TensorDictProvider`` by tierstate and as a plain state dict by the competitors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tierstate import TensorDictProvider
from tierstate.providers.items import Changes

from .tensors import state_tensor_bytes


class DictState:
    """``{name: tensor}`` with the same interface as :class:`~harness.gpt_state.GPTState` for saving."""

    def __init__(self, tensors: dict[str, torch.Tensor], changes: Changes = "any") -> None:
        self.provider = TensorDictProvider(tensors, changes)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.provider.tensors

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """In place, as tierstate restores: the competitors' restore writes into the same tensors."""
        self.provider.restore(state["tensors"])

    def providers(self) -> dict[str, Any]:
        return {"tensors": self.provider}

    @property
    def tensor_bytes(self) -> int:
        return state_tensor_bytes(self.tensors)


def synthetic_state(
    total_bytes: int, tensor_bytes: int, dtype: torch.dtype = torch.float32, changes: Changes = "any"
) -> DictState:
    """``total_bytes`` of weight-like values (normal, std 0.02) in tensors of ``tensor_bytes`` each,
    declared to tierstate as changing ``changes`` (``"any"``: copied on the trainer's thread;
    ``"never"``: captured lazily in the background, as an attached optimizer's state is)."""
    element = torch.empty((), dtype=dtype).element_size()
    count = max(1, total_bytes // tensor_bytes)
    numel = max(1, tensor_bytes // element)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(count):
        tensors[f"t{i:05d}"] = (torch.randn(numel, generator=generator) * 0.02).to(dtype)
    return DictState(tensors, changes)
