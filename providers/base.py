"""The provider protocol: describe state as items, restore it from the values read back.

A provider moves no bytes. ``describe()`` is called on the trainer thread when a checkpoint is
requested and must return quickly: tensors by reference, objects snapshotted. ``restore(state)``
receives ``{item key: tensor | object}`` for exactly the keys it described and puts them back,
in place where the state already exists.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def require_keys(owner: str, state: Mapping[str, Any], keys: set[str]) -> None:
    """Fail with one message naming every missing key, instead of a KeyError on the first."""
    missing = sorted(keys - set(state))
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise RestoreError(f"{owner}: checkpoint lacks {len(missing)} item(s): {shown}")
