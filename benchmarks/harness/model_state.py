"""A model and its optimizer as every benchmarked method saves them, and as tierstate registers them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tierstate import ModuleProvider, OptimizerProvider

from .tensors import state_tensor_bytes


class ModelOptimizerState:
    """Saving and restoring ``model`` and ``optimizer``; subclasses say how they are built and trained."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]:
        """The same content tierstate's providers describe: model state dict + optimizer state dict."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def providers(self) -> dict[str, Any]:
        return {"model": ModuleProvider(self.model), "optim": OptimizerProvider(self.optimizer)}

    @property
    def tensor_bytes(self) -> int:
        return state_tensor_bytes(self.state_dict())
