"""The provider protocol: describe state as items, restore it from the values read back.

A provider moves no bytes. ``describe()`` is called on the trainer thread when a checkpoint is
requested and must return quickly: tensors by reference, objects snapshotted. ``restore(state)``
receives ``{item key: tensor | object}`` for exactly the keys it described and puts them back,
in place where the state already exists.

A restore is all or nothing: it either restores every provider or leaves every one as it was.
Two ways get a provider there, and :class:`~providers.composite.CompositeProvider` applies them:

* A provider may also have ``check(state)`` (:class:`CheckedProvider`): it compares the values
  read back with the live state (keys, shapes, dtypes, an optimizer's parameter groups) and
  raises :class:`RestoreError` naming every difference, changing nothing. Passing ``check`` is a
  promise that ``restore`` of that state succeeds. Every provider's ``check`` runs before any
  provider restores, so a model with one layer of another shape leaves every tensor untouched. A
  checked provider costs nothing extra, which is why the big ones (module, optimizer) are checked.
* A provider without ``check`` (most user-written ones) cannot promise that, so it is copied
  before it restores (its ``describe()``, tensors cloned: a snapshot) and restored before the
  checked ones; if it, or any provider after it, fails, every snapshot is restored back, newest
  first. A provider whose ``describe()`` fails before the restore (its state does not exist yet)
  has no state to go back to and is restored without a snapshot. A checked provider that fails
  all the same breaks its promise: the snapshots are still put back, the checked providers
  restored before it are not.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, Set, ValuesView
from typing import Any, Protocol, runtime_checkable

from tierstate.errors import TierstateError

from .items import Item


class RestoreError(TierstateError):
    """The values read back do not fit the state the provider describes (missing keys, shapes)."""


@runtime_checkable
class StateProvider(Protocol):
    def describe(self) -> list[Item]:
        """Items for the current state; tensors referenced, objects already snapshotted."""
        ...

    def restore(self, state: Mapping[str, Any]) -> None:
        """Put back the values of a checkpoint, keyed like ``describe()``'s items."""
        ...


@runtime_checkable
class CheckedProvider(StateProvider, Protocol):
    """A provider that can tell, before anything is restored, whether ``restore(state)`` will succeed."""

    def check(self, state: Mapping[str, Any]) -> None:
        """Raise :class:`RestoreError` naming each item that does not fit the live state; change nothing."""
        ...


class ReadState(Mapping[str, Any]):
    """Values a restore has just read, keyed like ``describe()``'s items, and which tensors are fresh.

    A fresh tensor is memory the read allocated and nothing else references, so a provider whose
    target keeps the tensors it is given (a torch optimizer) may keep it instead of copying it:
    that saves a copy of the whole optimizer state on every restore. Any other tensor (one in a
    plain mapping a caller passed, one sharing memory with another item) must be copied. Read-only,
    so the keys marked fresh keep naming the very tensors that were read.
    """

    def __init__(self, values: Mapping[str, Any], fresh: Set[str] = frozenset()) -> None:
        self._values = values
        self.fresh = frozenset(fresh)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    # The mapping's own views, not Mapping's generic ones that look every key up again: a restore
    # walks states of 10^4 items once per provider.
    def __contains__(self, key: object) -> bool:
        return key in self._values

    def keys(self) -> KeysView[str]:
        return self._values.keys()

    def items(self) -> ItemsView[str, Any]:
        return self._values.items()

    def values(self) -> ValuesView[Any]:
        return self._values.values()


def fresh_keys(state: Mapping[str, Any]) -> frozenset[str]:
    """The keys of ``state`` whose tensors a provider may keep as they are: none unless it is a :class:`ReadState`."""
    return state.fresh if isinstance(state, ReadState) else frozenset()


def require_keys(owner: str, state: Mapping[str, Any], keys: set[str]) -> None:
    """Fail with one message naming every missing key, instead of a KeyError on the first."""
    missing = sorted(keys - set(state))
    if missing:
        raise RestoreError(f"{owner}: checkpoint lacks {len(missing)} item(s): {shown(missing)}")


def shown(names: list[str], limit: int = 8, sep: str = ", ") -> str:
    """The first ``limit`` names, joined by ``sep``, and ``...`` when there are more: errors stay readable."""
    return sep.join(names[:limit]) + (" ..." if len(names) > limit else "")
