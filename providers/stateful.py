"""Anything with ``state_dict()`` / ``load_state_dict()``: LR schedulers, GradScaler, samplers, optimizers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .base import RestoreError, require_keys
from .items import Item, ObjectItem, Serializer
from .tree import join_tensors, split_tensors

SKELETON_KEY = "skeleton"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


class StatefulProvider:
    """Tensors of ``state_dict()`` as tensor items keyed by their path, everything else as one object.

    The object item (key ``"skeleton"``) holds the structure with a marker per tensor; restoring
    joins the two and calls ``load_state_dict``. Tensors handed to ``restore`` are passed on as they
    are; subclasses whose target keeps them fix that in :meth:`_after_load`. ``replicated=True``
    says every rank holds the same state (the optimizer of a DDP model): many ranks write one copy.

    It has no ``check``: what an arbitrary ``load_state_dict`` accepts cannot be told in advance, so
    a restore snapshots the (small) state first and puts it back if anything fails (providers/base.py).
    """

    def __init__(self, obj: Stateful, serializer: Serializer = "msgpack", replicated: bool = False) -> None:
        if not isinstance(obj, Stateful):
            raise TypeError(f"{type(obj).__name__} has no state_dict()/load_state_dict()")
        self.obj = obj
        self.serializer: Serializer = serializer
        self.replicated = replicated

    @property
    def _owner(self) -> str:
        return type(self.obj).__name__

    def describe(self) -> list[Item]:
        skeleton, tensors = split_tensors(self.obj.state_dict(), replicated=self.replicated)
        if any(item.key == SKELETON_KEY for item in tensors):
            raise ValueError(f"{self._owner}: a tensor named {SKELETON_KEY!r} clashes with the skeleton item")
        return [*tensors, ObjectItem(SKELETON_KEY, skeleton, self.serializer, self.replicated)]

    def restore(self, state: Mapping[str, Any]) -> None:
        require_keys(self._owner, state, {SKELETON_KEY})
        state_dict = self._loadable(join_tensors(state[SKELETON_KEY], state, owner=self._owner))
        try:
            self.obj.load_state_dict(state_dict)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise RestoreError(f"{self._owner}: load_state_dict failed: {exc!r}") from exc
        self._after_load(state)

    def _loadable(self, state_dict: Any) -> Any:
        """The state dict as ``load_state_dict`` is handed it; subclasses may adapt what it reads."""
        return with_dropped_lambdas(self.obj, state_dict)

    def _after_load(self, state: Mapping[str, Any]) -> None:
        """Hook run after a successful ``load_state_dict``; ``state`` is what restore received."""


def with_dropped_lambdas(obj: object, state_dict: Any) -> Any:
    """A LambdaLR/MultiplicativeLR state that came through PyTorch DCP, made loadable again.

    torch saves one entry per lambda in ``lr_lambdas``: None for a function, the ``__dict__`` of any
    other callable, which for a ``functools.partial`` (transformers' and TorchTitan's schedules) is
    ``{}``. DCP keeps no empty container, so ``lr_lambdas: [{}]`` arrives missing, and torch's
    ``load_state_dict`` fails on the absent key. Only a list whose every entry was empty can vanish
    whole, so refilling it with one empty dict per live lambda restores exactly what was saved.
    """
    lambdas = getattr(obj, "lr_lambdas", None)
    if not isinstance(lambdas, list) or not isinstance(state_dict, dict) or "lr_lambdas" in state_dict:
        return state_dict
    return {**state_dict, "lr_lambdas": [{} for _ in lambdas]}

