"""The units a provider hands to the pipeline: one tensor or one Python object per item.

Providers only *describe* state. A :class:`TensorItem` holds a reference to the live tensor (no
copy: the pipeline copies it lazily, before the optimizer next mutates it); an :class:`ObjectItem`
holds a value that is already snapshotted, because Python objects can change at any moment.

With many ranks, an item says how it relates to the other ranks' items of the same key:
``replicated=True`` means every rank holds the same value (data-parallel parameters and optimizer
state), so one copy is written; a ``shard`` places this rank's piece in a global tensor; anything
else is per-rank (RNG state), written by every rank. Per-rank is the default because it never loses
data; a wrong ``replicated=True`` would keep one rank's value for all. One process ignores both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Serializer = Literal["json", "msgpack", "pickle"]
SERIALIZERS: tuple[str, ...] = ("json", "msgpack", "pickle")

# When a tensor's values may change, which decides whether the pipeline may copy it lazily (while the
# next forward/backward runs) or must copy it before ``checkpoint()`` returns:
#   "any"     anything may change it at any time (buffers updated in forward, user tensors): copied
#             before checkpoint() returns. The default, because a wrong value is worse than a slow copy.
#   "step"    only ``optimizer.step()`` changes it (trainable parameters, optimizer state): lazy when
#             an attached optimizer covers it, whose step pre-hook waits for the copy; else as "any".
#   "never"   nothing changes it while training (frozen parameters, a provider's own fresh copy).
#   "guarded" the user changes it only after ``runner.wait_captured()`` (e.g. an EMA of the model).
Changes = Literal["any", "step", "never", "guarded"]
CHANGES: tuple[str, ...] = ("any", "step", "never", "guarded")


@dataclass(frozen=True)
class ShardInfo:
    """Where this rank's piece sits in a larger, logically global tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.global_shape) != len(self.offsets):
            raise ValueError(f"shard global_shape {self.global_shape} and offsets {self.offsets} differ in rank")


@dataclass
class TensorItem:
    """One tensor, referenced, not copied; ``changes`` says when its values may change (see ``Changes``)."""

    key: str
    tensor: torch.Tensor
    shard: ShardInfo | None = None
    replicated: bool = False
    changes: Changes = "any"

    def __post_init__(self) -> None:
        if self.changes not in CHANGES:
            raise ValueError(f"item {self.key!r}: unknown changes={self.changes!r}, expected one of {CHANGES}")
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"item {self.key!r}: expected a torch.Tensor, got {type(self.tensor).__name__}")
        if self.tensor.layout != torch.strided:
            raise TypeError(f"item {self.key!r}: only strided (dense) tensors are supported, got {self.tensor.layout}")

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class ObjectItem:
    """One Python value, already snapshotted (deep-copied) when the checkpoint was requested."""

    key: str
    value: Any
    serializer: Serializer = "msgpack"
    replicated: bool = False

    def __post_init__(self) -> None:
        if self.serializer not in SERIALIZERS:
            raise ValueError(
                f"item {self.key!r}: unknown serializer {self.serializer!r}, expected one of {SERIALIZERS}"
            )


Item = TensorItem | ObjectItem


@dataclass(frozen=True)
class TensorBatch:
    """What a provider's ``describe`` would give, listed in C loops: its tensor items as parallel tuples
    (keys, tensor objects, ``changes``), and the few other items described afresh.

    A runner that sees the very tensor objects under the same keys and ``changes`` it planned last
    time reuses that plan instead of describing 10^5 items again (pipeline/plan_cache.py). The
    tensors are the live objects themselves (a module's ``Parameter``, not a detached alias), so a
    later ``p.data = ...`` is followed; ``others`` are the items that must be snapshotted at every
    request (an optimizer's skeleton with its learning rates, a module's extra state).
    """

    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    changes: Changes | tuple[Changes, ...]  # one for all the tensors, or one each
    others: tuple[Item, ...] = ()

    def changes_of(self, index: int) -> Changes:
        return self.changes if isinstance(self.changes, str) else self.changes[index]
