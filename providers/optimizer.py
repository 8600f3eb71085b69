"""Torch optimizers, whose ``load_state_dict`` needs one extra step to own its memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import fresh_keys
from .items import Item, Serializer, TensorItem
from .optimizer_check import check_optimizer_state
from .stateful import StatefulProvider


class OptimizerProvider(StatefulProvider):
    """A torch optimizer: ``state/<param index>/<name>`` tensors (``step`` included), param groups in the skeleton.

    ``Optimizer.load_state_dict`` keeps the given tensors whenever no dtype/device cast is needed
    (always for ``step``), so the optimizer would share memory with buffers the pipeline may reuse.
    After loading, every optimizer tensor that aliases an input is replaced by its own copy, unless the
    input is fresh (see :class:`~providers.base.ReadState`: just read, referenced by nothing else).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, serializer: Serializer = "msgpack", replicated: bool = False
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"OptimizerProvider needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        super().__init__(optimizer, serializer, replicated)
        self.optimizer = optimizer
        self._live: dict[tuple[int, str], torch.Tensor] = {}

    def describe(self) -> list[Item]:
        """Its tensors change only in ``optimizer.step()``: lazy once this optimizer is attached."""
        items = super().describe()
        for item in items:
            if isinstance(item, TensorItem):
                item.changes = "step"
        return items

    def check(self, state: Mapping[str, Any]) -> None:
        """Parameter groups and state shapes against the live optimizer, before anything is restored."""
        check_optimizer_state(self._owner, self.optimizer, state)

    def restore(self, state: Mapping[str, Any]) -> None:
        # The optimizer's tensors before loading: where one matches a loaded value, the value is copied
        # into it instead of cloned, so a restore into a live optimizer (a rollback) allocates nothing
        # new; fresh memory must be faulted in, which is slower than the copy (~1.4 vs ~5 GB/s here).
        self._live = {
            (id(param), name): value
            for param, param_state in self.optimizer.state.items()
            for name, value in param_state.items()
            if isinstance(value, torch.Tensor)
        }
        try:
            super().restore(state)
        finally:
            self._live = {}

    def _after_load(self, state: Mapping[str, Any]) -> None:
        inputs = {v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor)}
        fresh = {id(state[key]) for key in fresh_keys(state)}  # state holds them, so their ids stay theirs
        live = self._live
        for param, param_state in self.optimizer.state.items():
            for name, value in list(param_state.items()):
                if id(value) in fresh:
                    continue  # the restore's own fresh memory: the optimizer may simply keep it
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in inputs:
                    old = live.get((id(param), name))
                    if (
                        old is not None
                        and (old.shape, old.dtype, old.device) == (value.shape, value.dtype, value.device)
                        and old.untyped_storage().data_ptr() not in inputs
                    ):
                        param_state[name] = old.copy_(value)
                    else:
                        param_state[name] = value.clone()
