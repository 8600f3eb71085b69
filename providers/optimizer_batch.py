"""A torch optimizer's state listed for plan reuse, without ``state_dict()`` at every checkpoint.

``Optimizer.state_dict()`` packs every parameter's state in Python (13 ms for 25,000 parameters of
Adam here), then splitting it into tensors and a skeleton costs ~10 us per tensor: most of the
trainer's wait for a model with 10^5 state tensors, every checkpoint. Yet between two checkpoints
the state's structure (which parameters, in which order, which state names) rarely changes, only
the values, in place. So :class:`StateLister` compares that structure in C loops (ids, lengths,
names) with the one it last saw, and builds the item keys and the state's part of the skeleton only
when it changed. Where every parameter's state has the same names (Adam's ``step``, ``exp_avg``,
``exp_avg_sq``), the values are taken by name, one ``itemgetter`` call per parameter, which checks
the names on the way (as many as before, each present). A state of 75,000 tensors still takes
~20 ms in a training loop, where the step has pushed those objects out of the CPU caches: a memory
access per object, which any listing in Python pays. So for an attached optimizer, whose step (and
``load_state_dict``) waits for the capture, the runner takes at the request the state as last listed
when its outline (mapping, length, group sizes) has not moved, and lists it again in the background
before the capture (:meth:`StateLister.regrouped`, :meth:`StateLister.relisted`). The parameter
groups (learning rates, which a scheduler changes) are small and snapshotted at every request. The result is what
``OptimizerProvider.describe()`` gives, and the plan cache checks that against a real ``describe()``
before it relies on it.

Only an optimizer whose ``state_dict()`` is torch's own, without state-dict hooks, is listed so
(anything else may return what it likes), and only while all its state values are tensors (an
LBFGS counter is not: that optimizer is described item by item).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, pairwise, repeat
from typing import Any

import torch

from tierstate.errors import TierstateError

from .items import ObjectItem, Serializer, TensorBatch
from .stateful import SKELETON_KEY
from .tree import TENSOR_MARKER, split_tensors

_values = operator.methodcaller("values")


@dataclass(frozen=True)
class _Layout:
    """The keys and skeleton parts of one structure of the state, and the structure they were made for."""

    group_sizes: tuple[int, ...]
    params: tuple[torch.Tensor, ...]  # the parameters, whose positions give the indices in the keys
    owners: tuple[object, ...]  # the state's keys (parameters), in the state's order
    names: tuple[str, ...] | None  # the state names every parameter's state has (Adam's three), if they agree
    sizes: tuple[int, ...]  # else (names None): each parameter's state size ...
    all_names: tuple[str, ...]  # ... and every name, in order; empty when names says it all
    keys: tuple[str, ...] | None  # None: this structure is not listed (a non-tensor value, a state of no parameter)
    state: dict[Any, dict[str, Any]]  # the skeleton's "state": a marker per tensor
    indices: tuple[list[int], ...]  # the skeleton's "params" of each group

    def tensors(
        self, group_sizes: tuple[int, ...], params: tuple[torch.Tensor, ...], owners: tuple[object, ...], states: Any
    ) -> tuple[torch.Tensor, ...] | None:
        """The state's values in the order of :attr:`keys` if it has this structure (the same sizes and names,
        the very same parameter objects: never ``==``, tensors compare by value), else None."""
        if not (
            self.group_sizes == group_sizes
            and len(params) == len(self.params)
            and len(owners) == len(self.owners)
            and all(map(operator.is_, params, self.params))
            and all(map(operator.is_, owners, self.owners))
        ):
            return None
        if self.names is None:
            if self.sizes != tuple(map(len, states)) or self.all_names != tuple(chain.from_iterable(states)):
                return None
            return tuple(chain.from_iterable(map(_values, states)))
        if not self.names:
            return () if not any(states) else None
        if any(map(operator.ne, map(len, states), repeat(len(self.names)))):
            return None
        try:  # as many names as before, each of them there: the same names, whatever their order in each dict
            return tuple(chain.from_iterable(map(_getter(self.names), states)))
        except KeyError:
            return None


def _getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A parameter's state values under ``names``, in that order, as a tuple."""
    if len(names) == 1:
        name = names[0]
        return lambda values: (values[name],)
    return operator.itemgetter(*names)


def has_plain_state_dict(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``state_dict()`` is torch's own and no hook changes what it returns."""
    return (
        type(optimizer).state_dict is torch.optim.Optimizer.state_dict
        and not getattr(optimizer, "_optimizer_state_dict_pre_hooks", None)
        and not getattr(optimizer, "_optimizer_state_dict_post_hooks", None)
    )


@dataclass(frozen=True, eq=False)
class _Outline:
    """What a state listing can be checked against without touching each parameter: the state mapping (the
    object itself, held: ``load_state_dict`` replaces it), its length and the parameter groups' sizes."""

    state: object
    count: int
    group_sizes: tuple[int, ...]

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        return (
            self.state is optimizer.state
            and self.count == len(optimizer.state)
            and self.group_sizes == tuple(len(group["params"]) for group in optimizer.param_groups)
        )


class ListingOrderError(TierstateError, RuntimeError):
    """A call out of the order the DeferredListing protocol gives (providers/base.py); names the call."""


class StateLister:
    """Lists one optimizer's state as a :class:`TensorBatch`, reusing keys and skeleton while the structure holds.

    A runner whose optimizer is attached may also take the state as last listed at the request
    (:meth:`regrouped`: only the parameter groups snapshotted, O(groups)) and list it in the background
    (:meth:`relisted`) before the capture, which the optimizer's step waits for: see pipeline/plan_cache.py.
    """

    def __init__(self) -> None:
        self._layout: _Layout | None = None
        self._outline: _Outline | None = None  # the state's outline at the last listing

    def batch(self, optimizer: torch.optim.Optimizer, serializer: Serializer, replicated: bool) -> TensorBatch | None:
        listed = self._listed(optimizer)
        return None if listed is None else self._with_groups(optimizer, *listed, serializer, replicated)

    def relisted(self, optimizer: torch.optim.Optimizer) -> TensorBatch | None:
        """The state's tensors alone (no parameter groups, which a scheduler may be changing meanwhile)."""
        listed = self._listed(optimizer)
        return None if listed is None else listed[1]

    def _listed(self, optimizer: torch.optim.Optimizer) -> tuple[_Layout, TensorBatch] | None:
        """The state's layout and tensors (see :meth:`relisted`), the layout kept for the next listing."""
        if not has_plain_state_dict(optimizer):
            return None
        groups = optimizer.param_groups
        group_sizes = tuple(len(group["params"]) for group in groups)
        params = tuple(chain.from_iterable(group["params"] for group in groups))
        owners, states = tuple(optimizer.state), tuple(optimizer.state.values())
        layout = self._layout
        tensors = None if layout is None else layout.tensors(group_sizes, params, owners, states)
        if layout is None or tensors is None:
            layout = self._layout = _layout_of(group_sizes, params, owners, states)
            tensors = layout.tensors(group_sizes, params, owners, states)
        self._outline = _Outline(optimizer.state, len(owners), group_sizes)
        if layout.keys is None or tensors is None:
            return None
        return layout, TensorBatch(layout.keys, tensors, "step")

    def regrouped(
        self, optimizer: torch.optim.Optimizer, previous: TensorBatch, serializer: Serializer, replicated: bool
    ) -> TensorBatch | None:
        """``previous`` (this lister's latest listing) with the parameter groups as they are now, or None if the
        state's outline moved since that listing (a first step, a ``load_state_dict``, a new group)."""
        layout, outline = self._layout, self._outline
        if (
            layout is None
            or outline is None
            or previous.keys is not layout.keys
            or not has_plain_state_dict(optimizer)
            or not outline.holds(optimizer)
        ):
            return None
        return self._with_groups(optimizer, layout, previous, serializer, replicated)

    def restated(self, skeleton: dict[str, Any]) -> dict[str, Any]:
        """``skeleton`` (its groups as snapshotted at a request) with the state part of the latest listing."""
        if self._layout is None:
            raise ListingOrderError(
                "StateLister.restated: no listing yet to take the optimizer state from (the DeferredListing "
                "protocol lists first: tensor_batch(), then regrouped() or relisted())"
            )
        return {**skeleton, "state": self._layout.state}

    def _with_groups(
        self,
        optimizer: torch.optim.Optimizer,
        layout: _Layout,
        state: TensorBatch,
        serializer: Serializer,
        replicated: bool,
    ) -> TensorBatch:
        """``state``'s tensors (listed by ``layout``), and the parameter groups (learning rates, ...) and
        skeleton snapshotted now."""
        groups = optimizer.param_groups
        packed = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        group_skeletons, group_tensors = split_tensors(packed, key_prefix="param_groups", replicated=replicated)
        for skeleton, indices in zip(group_skeletons, layout.indices, strict=True):
            skeleton["params"] = indices
        for item in group_tensors:
            item.changes = "step"  # as OptimizerProvider.describe says of all its tensors
        skeleton = {"state": layout.state, "param_groups": group_skeletons}
        others = (*group_tensors, ObjectItem(SKELETON_KEY, skeleton, serializer, replicated))
        return TensorBatch(state.keys, state.tensors, "step", others)


def _layout_of(
    group_sizes: tuple[int, ...],
    params: tuple[torch.Tensor, ...],
    owners: tuple[object, ...],
    states: Sequence[Any],
) -> _Layout:
    """Keys and skeleton as ``state_dict()`` would name them: ``state/<index of the parameter>/<name>``; with
    the names every parameter's state shares (in the first one's order) when they agree."""
    index = {id(param): i for i, param in enumerate(params)}
    starts = [0, *accumulate(group_sizes)]
    indices = tuple(list(range(a, b)) for a, b in pairwise(starts))
    first = tuple(states[0]) if states and isinstance(states[0], dict) else None
    names = first if first is not None and all(isinstance(v, dict) and tuple(v) == first for v in states) else None
    sizes, all_names = ((), ()) if names is not None else (tuple(map(len, states)), tuple(chain.from_iterable(states)))
    unlisted = _Layout(group_sizes, params, owners, names, sizes, all_names, None, {}, indices)
    keys: list[str] = []
    state: dict[Any, dict[str, Any]] = {}
    for owner, values in zip(owners, states, strict=True):
        number = index.get(id(owner))
        if number is None or not isinstance(values, dict):
            return unlisted
        entry = state[number] = {}
        for name, value in values.items():
            if not isinstance(value, torch.Tensor) or not isinstance(name, str):
                return unlisted
            key = f"state/{number}/{name}"
            entry[name] = {TENSOR_MARKER: key}
            keys.append(key)
    return _Layout(group_sizes, params, owners, names, sizes, all_names, tuple(keys), state, indices)
