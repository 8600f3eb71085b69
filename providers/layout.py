"""How a named value of a framework's checkpoint maps to tierstate items, and back.

Frameworks hand over their state as one nested dict (Lightning's checkpoint dict, a DCP state
dict: ``{"model": {...}, "optim": {...}, "train_state": ...}``). Each top-level entry becomes what a
provider registered under that name describes, so the usual providers restore it:

- ``flat``: a dict of named tensors (a model's ``state_dict()``): one item per key, as
  :class:`~tierstate.ModuleProvider` and :class:`~tierstate.TensorDictProvider` describe them.
- ``stateful``: any other dict or list (an optimizer's, a scheduler's, a loop's state): tensors as
  items keyed by their path and the rest as one ``skeleton`` object, as
  :class:`~tierstate.StatefulProvider` and :class:`~tierstate.OptimizerProvider` describe them.
- ``value``: anything else (a number, a string, one tensor): the one item ``value``, as
  :class:`~tierstate.ObjectProvider` describes it.

Reading back, the layout is told by the item keys alone (:func:`rebuild`), so any tierstate
checkpoint (the ``flat`` items of an RNG provider, objects among them, included) comes back as a dict.

It lives in providers because it knows the item keys of the usual providers (the skeleton's, the
value's), which no module outside providers may; the integrations (Lightning, DCP) reach it through
the facade as ``tierstate.layout``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from ..tiers.format.objcodec import ObjectCodecError, encode_object
from .items import Item, ObjectItem, Serializer, TensorItem
from .objects import VALUE_KEY
from .stateful import SKELETON_KEY
from .tree import join_tensors, split_tensors

Layout = Literal["flat", "stateful", "value"]
LAYOUTS: tuple[Layout, ...] = ("flat", "stateful", "value")

ABSENT: Any = object()
"""What a :class:`ValueProvider`'s ``get`` returns when its name holds nothing this time (None is a value)."""


def layout_of(value: Any) -> Layout:
    """The layout a value is described in when nothing else says (see the module docstring)."""
    if isinstance(value, Mapping):
        keys = set(value)
        named_tensors = all(isinstance(k, str) for k in keys) and all(
            isinstance(v, torch.Tensor) for v in value.values()
        )
        # "skeleton" and a lone "value" are the other layouts' keys: such a dict is described as stateful,
        # so that rebuild() tells it apart.
        if value and named_tensors and SKELETON_KEY not in keys and keys != {VALUE_KEY}:
            return "flat"
        return "stateful"
    if isinstance(value, (list, tuple)):
        return "stateful"
    return "value"


def describe(value: Any, layout: Layout, serializer: Serializer = "msgpack") -> list[Item]:
    """The items of ``value`` in ``layout``; tensors by reference (the runner decides when to copy them)."""
    if layout == "flat":
        if not isinstance(value, Mapping):
            raise TypeError(f"the flat layout needs a dict of named values, got {type(value).__name__}")
        return [
            TensorItem(str(k), v) if isinstance(v, torch.Tensor) else ObjectItem(str(k), v, serializer)
            for k, v in value.items()
        ]
    if layout == "stateful":
        skeleton, tensors = split_tensors(value)
        if any(item.key == SKELETON_KEY for item in tensors):
            raise ValueError(f"a tensor named {SKELETON_KEY!r} clashes with the skeleton item")
        return [*tensors, ObjectItem(SKELETON_KEY, skeleton, serializer)]
    if isinstance(value, torch.Tensor):
        return [TensorItem(VALUE_KEY, value)]
    return [ObjectItem(VALUE_KEY, value, serializer)]


def serializer_for(items: list[Item], allow_pickle: bool) -> Serializer:
    """msgpack when it encodes every object item; else pickle when the policy allows it; else an
    ObjectCodecError naming the item msgpack refused."""
    for item in items:
        if isinstance(item, ObjectItem):
            try:
                encode_object(item.value, "msgpack")
            except ObjectCodecError as exc:
                if allow_pickle:
                    return "pickle"
                raise ObjectCodecError(f"item {item.key!r}: {exc}") from None
    return "msgpack"


def rebuild(state: Mapping[str, Any]) -> tuple[Any, Layout]:
    """The value a provider's items (keys without the provider's name) stand for, and their layout."""
    skeleton = state.get(SKELETON_KEY)
    if SKELETON_KEY in state and not isinstance(skeleton, torch.Tensor):
        return join_tensors(skeleton, state), "stateful"
    if set(state) == {VALUE_KEY}:
        return state[VALUE_KEY], "value"
    return dict(state), "flat"


def group_by_name(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"model/w": a, "optim/skeleton": b}`` -> ``{"model": {"w": a}, "optim": {"skeleton": b}}``."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        name, _, rest = key.partition("/")
        groups.setdefault(name, {})[rest] = value
    return groups


class ValueProvider:
    """One named value of a framework's state, described in its layout; ``restore`` keeps it as ``.value``.

    ``get`` is called at each checkpoint: it returns the value to describe, or :data:`ABSENT` when
    there is nothing under this name this time (then the provider describes no items).
    """

    def __init__(
        self, get: Callable[[], Any], layout: Layout | None = None, serializer: Serializer = "msgpack"
    ) -> None:
        self.get = get
        self.layout: Layout | None = layout
        self.serializer: Serializer = serializer
        self.value: Any = None

    def describe(self) -> list[Item]:
        value = self.get()
        if value is ABSENT:
            return []
        return describe(value, layout_of(value) if self.layout is None else self.layout, self.serializer)

    def restore(self, state: Mapping[str, Any]) -> None:
        self.value, _ = rebuild(state)
