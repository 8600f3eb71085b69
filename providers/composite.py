"""Named providers under one: item keys become ``<name>/<child key>``, nesting gives ``a/b/key``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .base import ReadState, RestoreError, StateProvider, fresh_keys
from .items import Item, TensorItem


class ChildRestoreError(RestoreError):
    """A child of a composite failed to restore; ``path`` names it through every level of nesting."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"provider {path!r}: {reason}")
        self.path = path
        self.reason = reason


def sub_state(state: Mapping[str, Any], name: str) -> ReadState:
    """The items under ``name/``, with that prefix removed: what a child described under ``name``.

    Tensors fresh in ``state`` (see :class:`ReadState`) stay fresh for the child.
    """
    prefix = f"{name}/"
    cut = len(prefix)
    values = {key[cut:]: value for key, value in state.items() if key.startswith(prefix)}
    return ReadState(values, {key[cut:] for key in fresh_keys(state) if key.startswith(prefix)})


class CompositeProvider:
    """Providers by name, described and restored as one; keys of unknown names are ignored on restore."""

    def __init__(self, **children: StateProvider) -> None:
        self._children: dict[str, StateProvider] = {}
        for name, child in children.items():
            self.add(name, child)

    def add(self, name: str, provider: StateProvider) -> CompositeProvider:
        """Register ``provider`` under ``name`` (non-empty, no ``/``, unused); returns self for chaining."""
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"provider name must be a non-empty string without '/', got {name!r}")
        if name in self._children:
            raise ValueError(f"a provider named {name!r} is already registered")
        if not isinstance(provider, StateProvider):
            raise TypeError(f"provider {name!r}: {type(provider).__name__} has no describe()/restore()")
        self._children[name] = provider
        return self

    @property
    def children(self) -> Mapping[str, StateProvider]:
        return MappingProxyType(self._children)

    def describe(self) -> list[Item]:
        return [
            dataclasses.replace(item, key=f"{name}/{item.key}")
            for name, child in self._children.items()
            for item in child.describe()
        ]

    def restore_targets(self, global_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorItem]:
        """The layouts children expect for saved tensors their live state does not describe yet, keyed like
        :meth:`describe`: from each child that has a ``restore_targets`` (see ``OptimizerProvider``)."""
        targets: dict[str, TensorItem] = {}
        for name, child in self._children.items():
            expect = getattr(child, "restore_targets", None)
            if expect is not None:
                mine = sub_state(global_shapes, name)
                targets |= {f"{name}/{k}": dataclasses.replace(t, key=f"{name}/{k}") for k, t in expect(mine).items()}
        return targets

    def restore(self, state: Mapping[str, Any]) -> None:
        for name, child in self._children.items():
            try:
                child.restore(sub_state(state, name))
            except ChildRestoreError as exc:
                raise ChildRestoreError(f"{name}/{exc.path}", exc.reason) from exc
            except RestoreError as exc:
                raise ChildRestoreError(name, str(exc)) from exc
