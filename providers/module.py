"""Parameters and buffers of an ``nn.Module``."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import RestoreError, shown
from .dtensor import like_live, tensor_item
from .fit import misfits, require_fit
from .items import Changes, Item, ObjectItem, Serializer

DDP_PREFIX = "module."  # what DistributedDataParallel puts before every key of the model it wraps


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
        self.serializer: Serializer = serializer
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

    def check(self, state: Mapping[str, Any]) -> None:
        """The same keys as ``state_dict()``, each tensor of the live shape and dtype; nothing is changed."""
        live = self.module.state_dict()
        expected, saved = set(live), set(state)
        missing, unexpected = sorted(expected - saved), sorted(saved - expected)
        problems = [f"checkpoint lacks {len(missing)} item(s): {shown(missing)}"] if missing else []
        if unexpected:
            problems.append(f"checkpoint has {len(unexpected)} item(s) the module lacks: {shown(unexpected)}")
        if problems:
            raise RestoreError(f"{self._owner}: {'; '.join(problems)}{_ddp_hint(expected, saved)}")
        require_fit(self._owner, misfits(live, state))

    def restore(self, state: Mapping[str, Any]) -> None:
        """Copy the values into the existing parameters and buffers, so optimizers keep their references.

        Checked first: ``load_state_dict`` copies entry by entry and reports a bad shape only after
        copying the others, which would leave the module half restored.
        """
        self.check(state)
        live = self.module.state_dict()
        self.module.load_state_dict({k: like_live(live[k], v) for k, v in state.items()}, strict=True)


def _ddp_hint(live: set[str], saved: set[str]) -> str:
    """Why two key sets that differ only by DistributedDataParallel's ``module.`` prefix differ, or ''."""
    if {k.removeprefix(DDP_PREFIX) for k in live} != {k.removeprefix(DDP_PREFIX) for k in saved}:
        return ""
    if all(k.startswith(DDP_PREFIX) for k in saved):
        return (
            f" (the keys differ only by DistributedDataParallel's {DDP_PREFIX!r} prefix: the checkpoint was saved "
            "from a DDP-wrapped model and this one is not; describe the same object in both runs, "
            "e.g. ModuleProvider(ddp_model.module) when saving)"
        )
    return (
        f" (the keys differ only by DistributedDataParallel's {DDP_PREFIX!r} prefix: this model is DDP-wrapped "
        "and the checkpoint's was not; register ModuleProvider(ddp_model.module))"
    )


def _changes(param: nn.Parameter | None) -> Changes:
    if param is None:
        return "any"
    return "step" if param.requires_grad else "never"
