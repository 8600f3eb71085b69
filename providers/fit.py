"""Whether the tensors read back fit the live tensors they go into: the core of a provider's ``check``.

A restore copies into the live tensors in place; a value of another shape either fails halfway
through (after other tensors were overwritten) or, copied byte for byte, silently scrambles the
tensor. So every value is compared before any is copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import RestoreError, shown
from .dtensor import is_dtensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``, which is what a restore reads back for it (a DTensor's local part)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def misfits(live: Mapping[str, Any], state: Mapping[str, Any], dtypes: bool = True) -> list[str]:
    """One line per live tensor whose value in ``state`` is not a tensor of its shape (and, with ``dtypes``, dtype).

    Keys missing from ``state`` and live values that are not tensors are not this function's business.
    """
    lines = []
    for key, want in live.items():
        if not isinstance(want, torch.Tensor) or key not in state:
            continue
        got = state[key]
        if not isinstance(got, torch.Tensor):
            lines.append(f"{key}: a {type(got).__name__} in the checkpoint, a tensor here")
            continue
        mine = local(want)
        if got.shape != mine.shape or (dtypes and got.dtype != mine.dtype):
            lines.append(f"{key}: checkpoint {_form(got)}, live {_form(mine)}")
    return lines


def require_fit(owner: str, lines: list[str]) -> None:
    """Raise one :class:`RestoreError` naming every misfit (the first few in full)."""
    if lines:
        listed = shown(lines, limit=4, sep="; ")
        raise RestoreError(f"{owner}: {len(lines)} tensor(s) differ in shape or dtype: {listed}")


def _form(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
