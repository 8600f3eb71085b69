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

from collections.abc import Callable, ItemsView, Iterator, KeysView, Mapping, Set, ValuesView
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from tierstate.errors import TierstateError

from .items import Item, TensorBatch

if TYPE_CHECKING:
    import torch


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


# --- Capabilities --------------------------------------------------------------------------------
# What the pipeline may ask of a provider beyond describe()/restore(). It tests these protocols, never a
# provider's class, so a provider written elsewhere that offers a capability is treated like the library's.


@runtime_checkable
class Batched(Protocol):
    """A provider that can list its tensors as one :class:`~providers.items.TensorBatch` in C loops, which lets
    a runner reuse its plan instead of describing 10^5 items at every checkpoint (pipeline/plan_cache.py).

    Order of calls, all on the trainer's thread at a request: ``tensor_batch()`` first; when the runner has
    no plan for this listing yet (the first request, or the listing changed), ``describe()`` next, which
    must give exactly the batch's tensor items (same keys, memory and ``changes``) and its ``others``
    alike, or the provider is described item by item from then on while its listing stays the same. On
    later requests that list the very same tensor objects under the same keys and ``changes``, only
    ``tensor_batch()`` is called; its ``others`` (small items such as an optimizer's skeleton) are planned
    afresh each time. ``tensor_batch()`` returns None when it cannot list this time (then ``describe()``).
    """

    def tensor_batch(self) -> TensorBatch | None: ...


@runtime_checkable
class OwnsOptimizer(Protocol):
    """A provider of a torch optimizer's state: ``register()`` attaches that optimizer (its step and
    ``load_state_dict`` pre-hooks wait for a pending capture), so its tensors are captured lazily.

    Called once, by ``runner.register``, right after the provider is registered."""

    def optimizer_to_attach(self) -> torch.optim.Optimizer: ...


@runtime_checkable
class DeferredListing(Batched, OwnsOptimizer, Protocol):
    """A batched provider whose listing may be taken, at a request, as it was last listed, and listed again in
    the background before any byte is captured: for an attached optimizer, whose step waits for the capture,
    so the state it holds at the request is still there then (pipeline/plan_cache.py, ``Resolve``).

    Order of calls: ``tensor_batch()`` at some earlier request gave the listing the runner planned. At a
    request, on the trainer's thread, ``regrouped(previous)`` (the latest listing) gives that listing with
    the few values that may have changed snapshotted now (``others``: learning rates, skeleton), or None
    if the listing may have other tensors (then ``tensor_batch()``). In the background, before capture:
    ``relisted()`` lists the tensors as they are (None: it cannot; the checkpoint fails and the next one
    lists on the trainer's thread); if that listing names other keys, ``restated(key, value)`` brings each
    ``others`` value snapshotted at the request up to date with it. Each of its tensors is then planned
    under ``replicated`` with the ``changes`` of its listing.
    """

    replicated: bool

    def regrouped(self, previous: TensorBatch) -> TensorBatch | None: ...

    def relisted(self) -> TensorBatch | None: ...

    def restated(self, key: str, value: Any) -> Any: ...


MissingRank = Literal["derive", "keep", "error"]


@runtime_checkable
class RankLocal(Protocol):
    """A provider whose state is each rank's own (random streams): restored on more ranks than saved
    it, a rank the checkpoint holds no value of its own for must never get another rank's (both ranks
    would draw the same dropout masks and samples).

    The restore reads the checkpoint's world size first; on a rank at or beyond it, such a provider
    (registered at the top level) is not restored from the checkpoint. ``missing_rank == "derive"``
    gives it a state of its own derived from rank 0's restored state and this rank (:meth:`derive`:
    distinct on every rank, the same on every restore of that checkpoint) and names it in
    ``RestoreResult.derived``; ``"keep"`` leaves its live state as it is and names it in
    ``RestoreResult.kept``; ``"error"`` fails the restore on every rank."""

    missing_rank: MissingRank

    def digest(self) -> bytes:
        """A digest of its live state (on rank 0 after a restore: the state that rank saved)."""
        ...

    def derive(self, digest: bytes, rank: int) -> None:
        """Set a state of its own for ``rank``, which the checkpoint holds none of, from ``digest`` (rank 0's
        :meth:`digest`) and ``rank``."""
        ...


class ReadState(Mapping[str, Any]):
    """Values a restore has just read, keyed like ``describe()``'s items, and which tensors are fresh.

    A fresh tensor is memory the read allocated and nothing else references, so a provider whose
    target keeps the tensors it is given (a torch optimizer) may keep it instead of copying it:
    that saves a copy of the whole optimizer state on every restore. Any other tensor (one in a
    plain mapping a caller passed, one sharing memory with another item) must be copied. Read-only,
    so the keys marked fresh keep naming the very tensors that were read.
    """

    def __init__(
        self, values: Mapping[str, Any], fresh: Set[str] = frozenset(), fill: Callable[[], None] | None = None
    ) -> None:
        self._values = values
        self.fresh = frozenset(fresh)
        # Reading still to be done into live tensors given among the values (tiers/reading/livefill.py: verified,
        # not read in yet): a restore runs it after the providers without check, before the checked ones.
        self.fill = fill

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
