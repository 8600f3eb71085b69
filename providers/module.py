"""Parameters and buffers of an ``nn.Module``."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .base import RestoreError, shown
from .dtensor import like_live, tensor_item
from .fit import misfits, require_fit
from .items import Changes, Item, ObjectItem, Serializer, TensorBatch
from .materialize import meta_keys
from .module_layout import ModuleLayout

DDP_PREFIX = "module."  # what DistributedDataParallel puts before every key of the model it wraps


class ModuleProvider:
    """One tensor item per ``state_dict()`` entry, keyed by its state-dict name.

    ``state_dict()`` tensors share storage with the parameters, so describing costs no copy. Tied
    parameters appear under each of their names; deduplicating storage is the pipeline's business.
    Non-tensor entries (``get_extra_state()``) become object items with ``serializer``.

    ``replicated=True`` says every rank holds the same values (a DDP model), so many ranks write
    one copy; DTensor entries (FSDP2, tensor parallel) are described by their own layout.

    ``frozen``: when parameters with ``requires_grad=False`` change. ``requires_grad`` says nothing
    about who writes a tensor (an EMA teacher is frozen and rewritten after every step), so by
    default (``"any"``) they are copied before ``checkpoint()`` returns, like buffers; declare
    ``frozen="never"`` for a base that truly never changes (a LoRA base model), and they are copied
    lazily, with the version-counter tripwire watching them.
    """

    def __init__(
        self, module: nn.Module, serializer: Serializer = "msgpack", replicated: bool = False, frozen: Changes = "any"
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ModuleProvider needs an nn.Module, got {type(module).__name__}")
        if frozen not in ("any", "never", "guarded"):
            raise ValueError(f"ModuleProvider(frozen=...): 'any', 'never' or 'guarded', got {frozen!r}")
        self.frozen: Changes = frozen
        self.module = module
        self.serializer: Serializer = serializer
        self.replicated = replicated
        # tensor_batch(): the entry types its changes were worked out for, and where the frozen parameters are
        self._listed_types: tuple[type, ...] | None = None
        self._frozen: list[int] | None = None
        self._listed_changes: tuple[Changes, ...] = ()
        # ... and the last listing (keys, values), reused while the module's layout holds
        self._listed: tuple[tuple[str, ...], tuple[torch.Tensor, ...]] = ((), ())
        self._layout: ModuleLayout | None = None

    @property
    def _owner(self) -> str:
        return f"module {type(self.module).__name__}"

    def describe(self) -> list[Item]:
        # Trainable parameters change only in optimizer.step() ("step": lazy when an attached optimizer
        # covers them); frozen ones as declared (``frozen``); buffers may change in any forward ("any").
        params = dict(self.module.named_parameters(remove_duplicate=False))
        return [
            tensor_item(name, value, self.replicated, _changes(params.get(name), self.frozen))
            if isinstance(value, torch.Tensor)
            else ObjectItem(name, copy.deepcopy(value), self.serializer, self.replicated)
            for name, value in self.module.state_dict().items()
        ]

    def tensor_batch(self) -> TensorBatch:
        """What :meth:`describe` gives, listed for plan reuse (pipeline/plan_cache.py): the live parameter and
        buffer objects (``state_dict(keep_vars=True)``: every hook runs, no detached alias is made, ~5x
        cheaper for 10^5 entries), each one's ``changes`` read off the object, other entries as objects.
        While nothing ``state_dict()`` depends on has changed (providers/module_layout.py: no module with
        hooks or its own listing, the same objects under the same names) the last listing is reused.

        The ``changes`` are worked out again when an entry's type changed, or a frozen parameter was
        unfrozen; a trainable one that was frozen may keep ``step`` (lazy where an attached optimizer
        holds it, else copied at once: safe either way), which spares touching 10^5 tensors.
        """
        if self._layout is None or not self._layout.holds():
            state = self.module.state_dict(keep_vars=True)
            self._layout = ModuleLayout.of(self.module)
            values = tuple(state.values())
            types = tuple(map(type, values))
            if types != self._listed_types:
                if not all(issubclass(kind, torch.Tensor) for kind in set(types)):
                    return self._mixed_batch(state)
                self._listed_types, self._frozen = types, None
            self._listed = (tuple(state), values)
        keys, values = self._listed
        if self._frozen is None or any(values[i].requires_grad for i in self._frozen):
            self._listed_changes = _changes_of(values, self.frozen)
            self._frozen = [i for i, v in enumerate(values) if isinstance(v, nn.Parameter) and not v.requires_grad]
        return TensorBatch(keys, values, self._listed_changes)

    def _mixed_batch(self, state: dict[str, Any]) -> TensorBatch:
        """A state dict with extra state (objects) besides its tensors: those are snapshotted every time."""
        self._listed_types, self._layout = None, None
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        extra = ((k, v) for k, v in state.items() if k not in tensors)
        others = tuple(ObjectItem(k, copy.deepcopy(v), self.serializer, self.replicated) for k, v in extra)
        return TensorBatch(tuple(tensors), tuple(tensors.values()), _changes_of(tensors.values(), self.frozen), others)

    def check(self, state: Mapping[str, Any]) -> None:
        """The same keys as ``state_dict()``, each tensor of the live shape and dtype; nothing is changed."""
        live = self.module.state_dict()
        on_meta = meta_keys(live)
        if on_meta:  # a copy into a meta tensor does nothing: the module would keep no value of the checkpoint
            raise RestoreError(
                f"{self._owner}: {len(on_meta)} tensor(s) are on the meta device, with no storage to restore "
                f"into: {shown(on_meta)}; call tierstate.materialize(module) (or module.to_empty) first"
            )
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


def _changes(param: nn.Parameter | None, frozen: Changes) -> Changes:
    if param is None:
        return "any"
    return "step" if param.requires_grad else frozen


def _changes_of(values: Iterable[torch.Tensor], frozen: Changes) -> tuple[Changes, ...]:
    """:func:`_changes` of each object ``state_dict(keep_vars=True)`` gives: a parameter is itself there.
    The plan cache compares these with :meth:`ModuleProvider.describe`'s before it relies on them."""
    return tuple(_changes(v if isinstance(v, nn.Parameter) else None, frozen) for v in values)
