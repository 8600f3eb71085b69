"""Plain Python values of the trainer (step counters, config, metrics), snapshotted when described."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from .base import require_keys
from .items import Item, ObjectItem, Serializer

VALUE_KEY = "value"


class ObjectProvider:
    """One object item ``"value"``: ``get()`` when ``get`` is callable, else ``get`` itself.

    The value is deep-copied at describe time because the trainer keeps changing it while the
    checkpoint is written. On restore the value is kept as ``.value``, passed to ``load`` when
    given, and, when ``get`` is a plain dict and no ``load`` is given, written into that dict in place.
    It has no ``check`` (``load`` may refuse anything): a restore snapshots the value first and puts
    it back if anything fails (providers/base.py).
    """

    def __init__(
        self,
        get: Callable[[], Any] | Any,
        load: Callable[[Any], None] | None = None,
        serializer: Serializer = "msgpack",
        replicated: bool = False,
    ) -> None:
        self.get = get
        self.load = load
        self.serializer: Serializer = serializer
        self.replicated = replicated  # the same value on every rank: many ranks write it once
        self.value: Any = None

    def describe(self) -> list[Item]:
        value = self.get() if callable(self.get) else self.get
        return [ObjectItem(VALUE_KEY, copy.deepcopy(value), self.serializer, self.replicated)]

    def restore(self, state: Mapping[str, Any]) -> None:
        require_keys("object", state, {VALUE_KEY})
        self.value = state[VALUE_KEY]
        if self.load is not None:
            self.load(self.value)
        elif isinstance(self.get, dict) and isinstance(self.value, dict):
            self.get.clear()
            self.get.update(self.value)
