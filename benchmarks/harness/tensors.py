"""The tensors inside a state dict, and their bytes as every method stores them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of mappings, lists and tuples (a model's or an optimizer's state dict)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from iter_tensors(value)


def state_tensor_bytes(state: Any) -> int:
    """Tensor bytes of a state, counting shared storage (tied weights) once, as every method stores it."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in iter_tensors(state):
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ident not in seen:
            seen.add(ident)
            total += t.numel() * t.element_size()
    return total
