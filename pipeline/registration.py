"""``runner.register(model=model, optim=opt, sched=scheduler)``: plain training objects, each in the
provider that fits it.

A provider given as it is (anything with ``describe()``/``restore()``) is kept; otherwise an
``nn.Module`` becomes a :class:`ModuleProvider`, a torch optimizer (or a wrapper of one, such as
accelerate's) an :class:`OptimizerProvider` of the optimizer inside, and anything else with
``state_dict()``/``load_state_dict()`` (DCP's ``Stateful``: LR schedulers, GradScaler, samplers) a
:class:`StatefulProvider`. Each is made with its defaults; options such as ``replicated=True``
(the same state on every rank) take the explicit provider.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tierstate.errors import TierstateError

from ..providers.base import StateProvider
from ..providers.module import ModuleProvider
from ..providers.optimizer import OptimizerProvider
from ..providers.stateful import Stateful, StatefulProvider
from .laziness import inner_optimizer


class RegistrationError(TierstateError, TypeError):
    """``register()`` was given something that is neither a provider nor a training object it can wrap."""


def provider_for(name: str, value: Any) -> StateProvider:
    """The provider that checkpoints ``value`` registered as ``name``; RegistrationError naming both
    when nothing fits."""
    if isinstance(value, StateProvider):
        return value
    if isinstance(value, nn.Module):
        return ModuleProvider(value)
    if isinstance(value, torch.optim.Optimizer):  # accelerate's and Lightning's wrappers are, too
        return OptimizerProvider(inner_optimizer(value) or value)
    if isinstance(value, Stateful):
        return StatefulProvider(value)
    raise RegistrationError(f"register({name}=...): {_what(value)} cannot be checkpointed; {_advice(value)}")


def _what(value: Any) -> str:
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _advice(value: Any) -> str:
    if isinstance(value, Mapping):
        return (
            "wrap a dict as ObjectProvider(d) (plain values, snapshotted) or TensorDictProvider(d) "
            "(tensors, restored in place)"
        )
    if isinstance(value, torch.Tensor):
        return "wrap tensors as TensorDictProvider({'name': tensor})"
    return (
        "pass an nn.Module, a torch optimizer, an object with state_dict()/load_state_dict(), "
        "or a provider (an object with describe()/restore())"
    )
