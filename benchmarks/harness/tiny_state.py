"""A 16 KiB module as the state a checkpoint saves: what checkpointing costs whatever the state's size."""

from __future__ import annotations

from typing import Any

import torch

from tierstate import ModuleProvider

from .tensors import state_tensor_bytes


class TinyState:
    """One ``Linear(64, 64)`` (16.6 KB), no optimizer: its tensors are copied before ``checkpoint()`` returns."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(64, 64)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def providers(self) -> dict[str, Any]:
        return {"model": ModuleProvider(self.model)}

    @property
    def tensor_bytes(self) -> int:
        return state_tensor_bytes(self.state_dict())
