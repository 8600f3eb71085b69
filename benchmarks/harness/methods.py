"""Every benchmarked method by name, built alike, and a set of them closed together."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .checkpointer import Checkpointer, NoCheckpoint
from .competitors import DCPAsyncCheckpointer, DCPSaveCheckpointer, TorchSaveCheckpointer
from .copy_floor import CopyFloorCheckpointer
from .dict_state import DictState
from .paths import fresh_dir
from .tierstate_checkpointer import SHM, TierstateCheckpointer, cache_for, memory_checkpointer

OTHERS: dict[str, Callable[[Any, Path], Checkpointer]] = {
    "none": NoCheckpoint,
    "copy-floor": CopyFloorCheckpointer,
    "torch.save": TorchSaveCheckpointer,
    "dcp.save": DCPSaveCheckpointer,
    "dcp.async_save": partial(DCPAsyncCheckpointer, staging="sync"),
    "dcp.async_save+async-staging": partial(DCPAsyncCheckpointer, staging="async"),
}

#: The memory tier (with slots) checkpointing a 16 KiB module instead of the trained state, beside the same
#: training: what a checkpoint costs the trainer whatever its size (the request, the threads, the commit, retention).
FIXED_COST = "tierstate(memory-16KiB)"
#: tierstate persisting to a memory tier in /dev/shm: captured into its slots, or (the comparison) not.
MEMORY_TIERS = {"tierstate(memory)": True, "tierstate(memory-no-slots)": False, FIXED_COST: True}


def make_checkpointer(name: str, state: Any, root: Path, **tierstate: Any) -> Checkpointer:
    """The method ``name`` saving ``state`` under ``root/<name>``. Any name starting with
    ``tierstate`` is tierstate, configured by the ``tierstate`` keyword arguments (see
    :class:`TierstateCheckpointer`); those of :data:`MEMORY_TIERS` persist to a memory tier in /dev/shm
    instead, and :data:`FIXED_COST` checkpoints a 16 KiB module there instead of ``state``. The other methods
    take no settings and ignore them, so one call builds any method of a list."""
    directory = root / "".join(c if c.isalnum() or c in "._-" else "-" for c in name)
    if name == FIXED_COST:  # a Linear(64, 64)'s tensors, copied before checkpoint() returns: no optimizer holds them
        state = DictState({"weight": torch.randn(64, 64), "bias": torch.randn(64)})
        tierstate = {**tierstate, "cache_bytes": cache_for(state.tensor_bytes), "optimizer": None}
    if name in MEMORY_TIERS:  # in /dev/shm, removed by the checkpointer's clear() and after the run
        return _in_memory(name, state, fresh_dir(SHM / f"tierstate-bench-{directory.name}"), **tierstate)
    directory.mkdir(parents=True, exist_ok=True)
    if name.startswith("tierstate"):
        ckpt = TierstateCheckpointer(state, directory, **tierstate)
        ckpt.name = name
        return ckpt
    if name not in OTHERS:
        raise ValueError(f"unknown method {name!r}: tierstate* or one of {', '.join(OTHERS)}")
    return OTHERS[name](state, directory)


def _in_memory(name: str, state: Any, directory: Path, **tierstate: Any) -> Checkpointer:
    ckpt = memory_checkpointer(state, directory, MEMORY_TIERS[name], **tierstate)
    ckpt.name = name
    return ckpt


def make_checkpointers(names: Iterable[str], state: Any, root: Path, **tierstate: Any) -> dict[str, Checkpointer]:
    """:func:`make_checkpointer` of every name, in order."""
    return {name: make_checkpointer(name, state, root, **tierstate) for name in names}


@contextlib.contextmanager
def closing_all(ckpts: dict[str, Checkpointer]) -> Iterator[dict[str, Checkpointer]]:
    """``ckpts``, each closed (its background work drained) and its checkpoints deleted on exit."""
    try:
        yield ckpts
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
            ckpt.clear()


def setups(ckpts: dict[str, Checkpointer]) -> dict[str, str]:
    """How each method was configured, for the report's notes."""
    return {name: ckpt.setup for name, ckpt in ckpts.items()}
