"""A dict of named tensors as a provider: the smallest useful one, for states that are not modules.

Restored in place, byte for byte: element copies are not implemented for some dtypes on the CPU
(the sub-byte and bit types, float8), and a byte copy is exact for every dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import require_keys
from .fit import misfits, require_fit
from .items import Changes, TensorBatch, TensorItem

OWNER = "TensorDictProvider"


class TensorDictProvider:
    """``{name: tensor}``, each tensor described by reference under its name and restored in place.

    ``changes`` declares when the tensors change (``providers.items.Changes``): by default "any", so
    they are copied before ``checkpoint()`` returns; an EMA the trainer updates only after
    ``runner.wait_captured()`` may say "guarded" and is then copied lazily.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], changes: Changes = "any") -> None:
        self.tensors = tensors
        self.changes: Changes = changes

    def describe(self) -> list[TensorItem]:
        return [TensorItem(key, t, changes=self.changes) for key, t in self.tensors.items()]

    def tensor_batch(self) -> TensorBatch:
        """What ``describe`` would describe, as two tuples: lets the runner reuse its plan (plan_cache.py)."""
        return TensorBatch(tuple(self.tensors), tuple(self.tensors.values()), self.changes)

    def check(self, state: Mapping[str, Any]) -> None:
        """Every name present, each value of its tensor's shape and dtype: a byte copy would take any same-sized one."""
        require_keys(OWNER, state, set(self.tensors))
        require_fit(OWNER, misfits(self.tensors, state))

    def restore(self, state: Mapping[str, Any]) -> None:
        self.check(state)
        for key, t in self.tensors.items():
            t.reshape(-1).view(torch.uint8).copy_(state[key].reshape(-1).view(torch.uint8))
