"""Torch optimizers, whose ``load_state_dict`` needs one extra step to own its memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from providers.items import Serializer
from providers.stateful import StatefulProvider


class OptimizerProvider(StatefulProvider):
    """A torch optimizer: ``state/<param index>/<name>`` tensors (``step`` included), param groups in the skeleton.

    ``Optimizer.load_state_dict`` keeps the given tensors whenever no dtype/device cast is needed
    (always for ``step``), so the optimizer would share memory with buffers the pipeline may reuse.
    After loading, every optimizer tensor that aliases an input is replaced by its own copy.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, serializer: Serializer = "msgpack") -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"OptimizerProvider needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        super().__init__(optimizer, serializer)
        self.optimizer = optimizer

    def _after_load(self, state: Mapping[str, Any]) -> None:
        inputs = {v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor)}
        for param_state in self.optimizer.state.values():
            for name, value in list(param_state.items()):
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in inputs:
                    param_state[name] = value.clone()
