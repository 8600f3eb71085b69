"""Which live tensors hold nothing a failed restore must protect: storage :func:`materialize` just gave them.

A restore into live training state verifies every frame before it writes a byte (tiers/reading/livefill.py):
a damaged copy must leave the state as it was. Into a model that :func:`providers.materialize.materialize`
built for the restore, there is nothing to leave as it was (uninitialised memory), so the restore may copy
each byte once, hashing as it copies, and a mismatch sends it on to the next copy, which overwrites all of it.

A tensor counts as fresh while its storage is the one materialize gave it and its version counter (which
every in-place op bumps: an optimizer step, ``copy_``, ``load_state_dict``) has not moved since. A restore
that filled it says so (:func:`spend`): its bytes, written from outside torch, bump no counter. Writes
through ``.data`` or raw memory bypass the counter too: a module initialised that way after
``materialize`` still counts as fresh, and a failed restore could leave it partly overwritten; initialise
it with in-place ops under ``torch.no_grad()`` instead (or build it without ``materialize``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

_lock = threading.Lock()
# storage address -> (the tensor given it, its version then); the weak reference tells a dead tensor whose
# address was reused from the one that was marked.
_marked: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}


def _version(tensor: torch.Tensor) -> int:
    return tensor._version  # noqa: SLF001  # the in-place version counter autograd checks; no public view


def _address(tensor: torch.Tensor) -> int | None:
    """Where a plain tensor's storage lies; None for one that has none of its own (empty, meta, a DTensor or
    another wrapper subclass: those are never restored in one pass)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or not tensor.numel() or tensor.is_meta:
        return None
    return tensor.untyped_storage().data_ptr()


def mark_fresh(tensors: Iterable[torch.Tensor]) -> None:
    """Record ``tensors`` as holding uninitialised storage (nothing to protect) as of now."""
    with _lock:
        for address in [a for a, (ref, _) in _marked.items() if ref() is None]:
            del _marked[address]
        for tensor in tensors:
            if (address := _address(tensor)) is not None:
                _marked[address] = (weakref.ref(tensor), _version(tensor))


def is_fresh(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a view sharing its storage and version counter, as ``detach()`` gives) still
    holds the uninitialised storage :func:`mark_fresh` recorded, untouched by any in-place op since."""
    address = _address(tensor)
    with _lock:
        entry = None if address is None else _marked.get(address)
    if entry is None:
        return False
    marked = entry[0]()
    return marked is not None and _version(marked) == entry[1] == _version(tensor)


def spend(tensors: Iterable[torch.Tensor]) -> None:
    """``tensors`` now hold restored values (written without a version bump): no longer fresh."""
    with _lock:
        for tensor in tensors:
            if (address := _address(tensor)) is not None:
                _marked.pop(address, None)
