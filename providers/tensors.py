"""A dict of named tensors as a provider: the smallest useful one, for states that are not modules.

Restored in place: the common dtypes by one batched element copy (exact: the dtypes match), the
others byte for byte, since element copies are not implemented for some dtypes on the CPU (the
sub-byte and bit types, float8), and a byte copy is exact for every dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import require_keys
from .fit import misfits, require_fit
from .items import Changes, TensorBatch, TensorItem

OWNER = "TensorDictProvider"
# Dtypes whose element copy is a plain copy of their bytes (same dtype, checked): copied in one batch.
# Not bool: its element copy turns any nonzero byte into 1.
ELEMENT_COPY = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
})


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
        live, read = [], []
        for key, t in self.tensors.items():
            if t.dtype in ELEMENT_COPY:
                live.append(t)
                read.append(state[key])
            else:
                t.reshape(-1).view(torch.uint8).copy_(state[key].reshape(-1).view(torch.uint8))
        if live:  # one call for all of them: 10^5 separate copies cost most of a second
            torch._foreach_copy_(live, read)  # pyright: ignore[reportPrivateImportUsage]
