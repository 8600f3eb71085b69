"""A torch optimizer's state listed for plan reuse, without ``state_dict()`` at every checkpoint.

``Optimizer.state_dict()`` packs every parameter's state in Python (13 ms for 25,000 parameters of
Adam here), then splitting it into tensors and a skeleton costs ~10 us per tensor: most of the
trainer's wait for a model with 10^5 state tensors, every checkpoint. Yet between two checkpoints
the state's structure (which parameters, in which order, which state names) rarely changes, only
the values, in place. So :class:`StateLister` compares that structure in C loops (ids, lengths,
names) with the one it last saw, and builds the item keys and the state's part of the skeleton only
when it changed; the parameter groups (learning rates, which a scheduler changes) are small and
snapshotted at every request. The result is what ``OptimizerProvider.describe()`` gives, and the
plan cache checks that against a real ``describe()`` before it relies on it.

Only an optimizer whose ``state_dict()`` is torch's own, without state-dict hooks, is listed so
(anything else may return what it likes), and only while all its state values are tensors (an
LBFGS counter is not: that optimizer is described item by item).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from .items import ObjectItem, Serializer, TensorBatch
from .stateful import SKELETON_KEY
from .tree import TENSOR_MARKER, split_tensors

_values = operator.methodcaller("values")


@dataclass(frozen=True)
class _Layout:
    """The keys and skeleton parts of one structure of the state, and the structure they were made for."""

    signature: tuple[Any, ...]  # group sizes, state sizes and names: compared with ==
    params: tuple[torch.Tensor, ...]  # the parameters, whose positions give the indices in the keys
    owners: tuple[object, ...]  # the state's keys (parameters), in the state's order
    keys: tuple[str, ...] | None  # None: this structure is not listed (a non-tensor value, a state of no parameter)
    state: dict[Any, dict[str, Any]]  # the skeleton's "state": a marker per tensor
    indices: tuple[list[int], ...]  # the skeleton's "params" of each group

    def fits(self, signature: tuple[Any, ...], params: tuple[torch.Tensor, ...], owners: tuple[object, ...]) -> bool:
        """Whether the state has this structure: the same sizes and names, the very same objects (never ``==``:
        tensors compare by value)."""
        return (
            self.signature == signature
            and len(params) == len(self.params)
            and len(owners) == len(self.owners)
            and all(map(operator.is_, params, self.params))
            and all(map(operator.is_, owners, self.owners))
        )


def has_plain_state_dict(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``state_dict()`` is torch's own and no hook changes what it returns."""
    return (
        type(optimizer).state_dict is torch.optim.Optimizer.state_dict
        and not getattr(optimizer, "_optimizer_state_dict_pre_hooks", None)
        and not getattr(optimizer, "_optimizer_state_dict_post_hooks", None)
    )


class StateLister:
    """Lists one optimizer's state as a :class:`TensorBatch`, reusing keys and skeleton while the structure holds."""

    def __init__(self) -> None:
        self._layout: _Layout | None = None

    def batch(self, optimizer: torch.optim.Optimizer, serializer: Serializer, replicated: bool) -> TensorBatch | None:
        if not has_plain_state_dict(optimizer):
            return None
        groups = optimizer.param_groups
        params = tuple(chain.from_iterable(group["params"] for group in groups))
        owners, states = tuple(optimizer.state), tuple(optimizer.state.values())
        signature = (
            tuple(len(group["params"]) for group in groups),
            tuple(map(len, states)),
            tuple(chain.from_iterable(states)),  # the state names, in order
        )
        layout = self._layout
        if layout is None or not layout.fits(signature, params, owners):
            layout = self._layout = _layout_of(signature, params, owners, states, groups)
        if layout.keys is None:
            return None
        tensors = tuple(chain.from_iterable(map(_values, states)))
        packed = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        group_skeletons, group_tensors = split_tensors(packed, key_prefix="param_groups", replicated=replicated)
        for skeleton, indices in zip(group_skeletons, layout.indices, strict=True):
            skeleton["params"] = indices
        for item in group_tensors:
            item.changes = "step"  # as OptimizerProvider.describe says of all its tensors
        skeleton = {"state": layout.state, "param_groups": group_skeletons}
        others = (*group_tensors, ObjectItem(SKELETON_KEY, skeleton, serializer, replicated))
        return TensorBatch(layout.keys, tensors, "step", others)


def _layout_of(
    signature: tuple[Any, ...],
    params: tuple[torch.Tensor, ...],
    owners: tuple[object, ...],
    states: Sequence[Any],
    groups: Sequence[dict[str, Any]],
) -> _Layout:
    """Keys and skeleton as ``state_dict()`` would name them: ``state/<index of the parameter>/<name>``."""
    index = {id(param): i for i, param in enumerate(params)}
    starts = [0]
    for group in groups:
        starts.append(starts[-1] + len(group["params"]))
    indices = tuple(list(range(a, b)) for a, b in zip(starts, starts[1:], strict=False))
    keys: list[str] = []
    state: dict[Any, dict[str, Any]] = {}
    for owner, values in zip(owners, states, strict=True):
        number = index.get(id(owner))
        if number is None or not isinstance(values, dict):
            return _Layout(signature, params, owners, None, {}, indices)
        entry = state[number] = {}
        for name, value in values.items():
            if not isinstance(value, torch.Tensor) or not isinstance(name, str):
                return _Layout(signature, params, owners, None, {}, indices)
            key = f"state/{number}/{name}"
            entry[name] = {TENSOR_MARKER: key}
            keys.append(key)
    return _Layout(signature, params, owners, tuple(keys), state, indices)
