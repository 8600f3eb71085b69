"""Building a model for a restore without initialising it: the work a restore overwrites, skipped.

A restarted trainer builds its model and optimizer only to overwrite every value with the checkpoint:
random init of every parameter is wasted work (seconds for a large model, and all of its memory
touched twice). Built under ``torch.device("meta")`` the model has shapes and no storage, so its
construction costs next to nothing (:func:`empty_init` also skips the init calls, which torch runs
even on the meta device); :func:`materialize` gives each parameter and buffer uninitialised
storage on the real device, and the restore fills it, copying each byte once (there is nothing to
protect from a damaged copy: providers/fresh.py). An optimizer built on the materialised parameters holds
no state until the restore adopts the checkpoint's (providers/optimizer.py).

Uninitialised storage is garbage until restored, so nothing may be left unrestored:

* the module's restore refuses a checkpoint that lacks any of its state-dict entries
  (:meth:`ModuleProvider.check`; the entries it has may have been read into the fresh tensors by
  then, which held nothing to keep), and a module still on the meta device is refused (a copy into a
  meta tensor does nothing, silently);
* buffers registered with ``persistent=False`` are in no state dict, so no checkpoint holds them:
  :func:`materialize` refuses a module with such buffers on the meta device, naming them (build
  them on the real device, e.g. register them after materialising, or compute them again);
* ``nn.Module.to_empty`` unties tied parameters (one ``Parameter`` under two names becomes two):
  :func:`materialize` ties them again, so that the restore's single copy serves both names, as in
  the module that was saved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .base import RestoreError, shown
from .fresh import mark_fresh

# torch.nn.init's functions that fill a tensor: what module constructors and init code call.
_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip


def _no_init(tensor: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
    return tensor


@contextmanager
def empty_init() -> Iterator[None]:
    """Build modules with no storage and no init: under ``torch.device("meta")``, with torch.nn.init's
    filling functions made no-ops meanwhile. On the meta device those would fill nothing, but torch runs
    them there through ``torch._refs``, whose first use imports ``torch._dynamo`` (~1.5 s on a 2-core
    machine, more than building a 25 M-parameter GPT with its init): skipped, a meta build takes
    milliseconds. The functions are swapped process-wide while the block runs: build nothing else
    meanwhile, on another thread."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS if hasattr(torch.nn.init, name)}
    for name in saved:
        setattr(torch.nn.init, name, _no_init)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


class MetaBufferError(RestoreError):
    """A module on the meta device holds buffers no checkpoint stores (``persistent=False``); names them."""


def _tied(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each parameter held under more than one (module, name), as those places."""
    places: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for owner in module.modules():
        for name, param in owner._parameters.items():  # noqa: SLF001  # the one place ties live; no public view
            if param is not None:
                places[id(param)].append((owner, name))
    return [group for group in places.values() if len(group) > 1]


def _meta_transient_buffers(module: nn.Module) -> list[str]:
    """Names of the buffers on the meta device that are not in the state dict (``persistent=False``)."""
    found = []
    for prefix, owner in module.named_modules():
        transient = owner._non_persistent_buffers_set  # noqa: SLF001  # no public view of persistence
        for name, buffer in owner.named_buffers(recurse=False):
            if name in transient and buffer is not None and buffer.is_meta:
                found.append(f"{prefix}.{name}" if prefix else name)
    return found


def materialize(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give a module built on the meta device uninitialised storage on ``device``, ties kept, for a
    restore to fill: ``with torch.device("meta"): model = GPT(config)``, then ``materialize(model)``,
    then build the optimizer on ``model.parameters()``, register both and ``runner.restore()``.

    Returns ``module``. MetaBufferError if it has buffers on the meta device that no checkpoint holds
    (``persistent=False``). Parameters already off the meta device are moved to ``device`` uninitialised
    too (``to_empty``): call it only on a module whose every value the restore provides.
    """
    transient = _meta_transient_buffers(module)
    if transient:
        raise MetaBufferError(
            f"module {type(module).__name__}: {len(transient)} buffer(s) on the meta device are not in its "
            f"state dict (persistent=False), so no checkpoint restores them: {shown(transient)}; build them on "
            "a real device (or compute them again after materialize)"
        )
    ties = _tied(module)
    module.to_empty(device=device)
    for places in ties:
        owner, name = places[0]
        shared = owner._parameters[name]  # noqa: SLF001  # see _tied
        for other, other_name in places[1:]:
            other._parameters[other_name] = shared  # noqa: SLF001  # re-tie what to_empty untied
    mark_fresh([*module.parameters(), *module.buffers()])  # a restore copies into them once (providers/fresh.py)
    return module


def meta_keys(state: dict[str, object]) -> list[str]:
    """The keys of a state dict whose tensors are on the meta device (nothing a restore could fill)."""
    return [key for key, value in state.items() if isinstance(value, torch.Tensor) and value.is_meta]
