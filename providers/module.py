"""Parameters and buffers of an ``nn.Module``."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import RestoreError, require_keys
from .dtensor import like_live, tensor_item
from .items import Changes, Item, ObjectItem, Serializer


class ModuleProvider:
    """One tensor item per ``state_dict()`` entry, keyed by its state-dict name.

    ``state_dict()`` tensors share storage with the parameters, so describing costs no copy. Tied
    parameters appear under each of their names; deduplicating storage is the pipeline's business.
    Non-tensor entries (``get_extra_state()``) become object items with ``serializer``.

    ``replicated=True`` says every rank holds the same values (a DDP model), so many ranks write
    one copy; DTensor entries (FSDP2, tensor parallel) are described by their own layout.
    """

    def __init__(self, module: nn.Module, serializer: Serializer = "msgpack", replicated: bool = False) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ModuleProvider needs an nn.Module, got {type(module).__name__}")
        self.module = module
        self.serializer = serializer
        self.replicated = replicated

    @property
    def _owner(self) -> str:
        return f"module {type(self.module).__name__}"

    def describe(self) -> list[Item]:
        # Trainable parameters change only in optimizer.step() ("step": lazy when an attached optimizer
        # covers them); frozen ones not at all ("never"); buffers may change in any forward ("any").
        params = dict(self.module.named_parameters(remove_duplicate=False))
        return [
            tensor_item(name, value, self.replicated, _changes(params.get(name)))
            if isinstance(value, torch.Tensor)
            else ObjectItem(name, copy.deepcopy(value), self.serializer, self.replicated)
            for name, value in self.module.state_dict().items()
        ]

    def restore(self, state: Mapping[str, Any]) -> None:
        """Copy the values into the existing parameters and buffers, so optimizers keep their references."""
        live = self.module.state_dict()
        expected = set(live)
        require_keys(self._owner, state, expected)
        unexpected = sorted(set(state) - expected)
        if unexpected:
            names = ", ".join(unexpected)
            raise RestoreError(f"{self._owner}: checkpoint has {len(unexpected)} item(s) the module lacks: {names}")
        try:
            self.module.load_state_dict({k: like_live(live[k], v) for k, v in state.items()}, strict=True)
        except RuntimeError as exc:  # size mismatches, listed by name in torch's message
            raise RestoreError(f"{self._owner}: {exc}") from exc


def _changes(param: nn.Parameter | None) -> Changes:
    if param is None:
        return "any"
    return "step" if param.requires_grad else "never"
