"""Named providers under one: item keys become ``<name>/<child key>``, nesting gives ``a/b/key``.

A restore is all or nothing across every provider of the tree (see providers/base.py): nested
composites are flattened into their leaves, which are checked and restored as one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from tierstate.errors import TierstateError

from .atomic import AtomicRestore
from .base import Batched, CheckedProvider, ReadState, StateProvider, fresh_keys
from .items import Item, TensorItem


def sub_state(state: Mapping[str, Any], name: str) -> ReadState:
    """The items under ``name/``, with that prefix removed: what a child described under ``name``.

    Tensors fresh in ``state`` (see :class:`ReadState`) stay fresh for the child.
    """
    prefix = f"{name}/"
    cut = len(prefix)
    values = {key[cut:]: value for key, value in state.items() if key.startswith(prefix)}
    return ReadState(values, {key[cut:] for key in fresh_keys(state) if key.startswith(prefix)})


class ProviderNameError(TierstateError, ValueError):
    """A provider name that cannot be registered: empty, holding ``/``, or taken already."""


class CompositeProvider:
    """Providers by name, described and restored as one; keys of unknown names are ignored on restore."""

    def __init__(self, **children: StateProvider) -> None:
        self._children: dict[str, StateProvider] = {}
        for name, child in children.items():
            self.add(name, child)

    def add_all(self, providers: Mapping[str, StateProvider]) -> None:
        """Register every one of ``providers``, or (a name taken or invalid) none of them."""
        trial = CompositeProvider(**self._children)
        for name, provider in providers.items():
            trial.add(name, provider)
        self._children = trial._children    # its own class

    def add(self, name: str, provider: StateProvider) -> CompositeProvider:
        """Register ``provider`` under ``name`` (non-empty, no ``/``, unused); returns self for chaining."""
        if not isinstance(name, str) or not name or "/" in name:
            raise ProviderNameError(f"provider name must be a non-empty string without '/', got {name!r}")
        if name in self._children:
            raise ProviderNameError(
                f"a provider named {name!r} is already registered (registered: {', '.join(self._children)})"
            )
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

    def check(self, state: Mapping[str, Any]) -> None:
        """Raise :class:`~providers.atomic.ChildRestoreError` if a checked provider does not fit ``state``."""
        self.restoring(state).check()

    def restore(self, state: Mapping[str, Any]) -> None:
        """Check every provider, then restore them all; if any fails, every one is left as it was."""
        restoring = self.restoring(state)
        restoring.check()
        restoring.restore()

    def restoring(self, state: Mapping[str, Any]) -> AtomicRestore:
        """The restore of ``state`` into every provider of the tree, in steps (for ranks that agree between them)."""
        fill = state.fill if isinstance(state, ReadState) else None
        return AtomicRestore([(path, leaf, sub_state(state, path)) for path, leaf in self.leaves()], fill)

    def restore_destinations(self) -> dict[str, torch.Tensor]:
        """The live tensors of the checked providers, by item key: where a restore may read the stored
        bytes straight in (tiers/reading/livefill.py), since the checked providers are restored last, after every
        provider was checked (:meth:`AtomicRestore.restore_checked` fills them first). Listed with
        ``tensor_batch()`` where a provider has it (C loops, and no ``describe()`` that a runner counts on
        for its plans), else ``describe()``; a provider whose listing fails offers none (its restore says why)."""
        live: dict[str, torch.Tensor] = {}
        for path, leaf in self.leaves():
            if not isinstance(leaf, CheckedProvider):
                continue
            try:
                batch = leaf.tensor_batch() if isinstance(leaf, Batched) else None
                if batch is not None:
                    live |= {f"{path}/{key}": t for key, t in zip(batch.keys, batch.tensors, strict=True)}
                    continue
                items = leaf.describe()
            except Exception:  # its own restore reports it
                continue
            live |= {f"{path}/{i.key}": i.tensor for i in items if isinstance(i, TensorItem) and i.shard is None}
        return live

    def leaves(self, prefix: str = "") -> list[tuple[str, StateProvider]]:
        """Every provider that is not itself a composite, by its path (``a/b``)."""
        leaves = []
        for name, child in self._children.items():
            path = f"{prefix}{name}"
            leaves += child.leaves(f"{path}/") if isinstance(child, CompositeProvider) else [(path, child)]
        return leaves
