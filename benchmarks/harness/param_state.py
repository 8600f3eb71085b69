"""A model of many small parameters and its Adam: 10^4-10^5 tensors of optimizer state per rank, the shape
of a large or mixture-of-experts model's state, registered as a real model and optimizer (lazy capture)."""

from __future__ import annotations

import torch

from .model_state import ModelOptimizerState

TENSORS_PER_PARAM = 4  # the parameter, Adam's two moments and its step


class ParamState(ModelOptimizerState):
    """``count`` tensors: ``count / 4`` parameters of ``elements`` float32 each, and Adam's state after one step."""

    def __init__(self, count: int, elements: int) -> None:
        generator = torch.Generator().manual_seed(0)
        params = [torch.randn(elements, generator=generator) for _ in range(max(1, count // TENSORS_PER_PARAM))]
        self.model = torch.nn.ParameterList([torch.nn.Parameter(p) for p in params])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.train_step()

    def train_step(self) -> None:
        torch.stack([p.sum() for p in self.model]).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
