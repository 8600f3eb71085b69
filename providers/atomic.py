"""Restoring several providers as one: every one of them, or none (the rule is in providers/base.py).

The steps are separate so that many ranks can agree between them: every rank checks, then every
rank restores the providers without ``check``, then the checked ones; a rank whose peers failed
a step undoes what it restored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .base import CheckedProvider, ReadState, RestoreError, StateProvider
from .items import TensorItem

log = logging.getLogger("tierstate")

Part = tuple[str, StateProvider, Mapping[str, Any]]
"""One provider of a restore: its path (``a/b``), the provider, and the state it restores."""


class ChildRestoreError(RestoreError):
    """A child of a composite failed to restore; ``path`` names it through every level of nesting."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"provider {path!r}: {reason}")
        self.path = path
        self.reason = reason


class AtomicRestore:
    """One restore of several providers: :meth:`check` them all, then :meth:`restore` them, or :meth:`undo` it."""

    def __init__(self, parts: Sequence[Part], fill: Callable[[], None] | None = None) -> None:
        self.parts = list(parts)
        # The checked providers' live tensors the read left to fill (see ReadState.fill): done first
        # thing in restore_checked, once every provider was checked and the unchecked ones restored.
        self._fill = fill
        self._snapshots: list[tuple[str, StateProvider, ReadState]] = []  # of the providers restored so far

    def check(self) -> None:
        """Every checked provider compares the state with its live state; nothing is changed."""
        for path, provider, state in self.parts:
            if isinstance(provider, CheckedProvider):
                with _naming(path):
                    provider.check(state)

    def restore(self) -> None:
        """Restore every provider: those without ``check`` first, each after a snapshot of it, then the checked ones.

        If one fails, every provider restored so far (the failing one included) is put back from
        its snapshot before the error is raised; a rollback that fails too is noted on the error.
        """
        self.restore_unchecked()
        self.restore_checked()

    def restore_unchecked(self) -> None:
        """The first half of :meth:`restore`: the providers without ``check``, each after a snapshot of it."""
        for path, provider, state in self.parts:
            if not isinstance(provider, CheckedProvider):
                snapshot = _snapshot(path, provider)
                if snapshot is not None:
                    self._snapshots.append((path, provider, snapshot))
                self._restore(path, provider, state)

    def restore_checked(self) -> None:
        """The second half of :meth:`restore`: the checked providers, which promised to succeed.

        First the bytes read straight into their live tensors, if any (the read verified them all);
        if that fails the unchecked providers are put back and the error says what was overwritten.
        """
        if self._fill is not None:
            fill, self._fill = self._fill, None
            try:
                fill()
            except Exception as exc:
                exc.add_note("while reading into the live tensors; the providers without check were put back")
                for problem in self.undo():
                    exc.add_note(problem)
                raise
        for path, provider, state in self.parts:
            if isinstance(provider, CheckedProvider):
                self._restore(path, provider, state)

    def _restore(self, path: str, provider: StateProvider, state: Mapping[str, Any]) -> None:
        try:
            with _naming(path):
                provider.restore(state)
        except Exception as exc:
            exc.add_note(f"while restoring provider {path!r}; the providers without check were put back")
            for problem in self.undo():
                exc.add_note(problem)
            raise

    def undo(self) -> list[str]:
        """Put back every provider without ``check`` that :meth:`restore` restored, newest first.

        Returns what could not be put back (a provider whose restore of its own snapshot failed).
        """
        problems = []
        for path, provider, snapshot in reversed(self._snapshots):
            try:
                provider.restore(snapshot)
            except Exception as exc:
                problems.append(f"rolling back provider {path!r} failed too, its state is undefined: {exc!r}")
        self._snapshots = []
        return problems


def _snapshot(path: str, provider: StateProvider) -> ReadState | None:
    """What ``provider`` holds now, as a state its ``restore`` takes back: tensors cloned, objects as described."""
    try:
        items = provider.describe()
    except Exception as exc:
        log.info("restore: provider %r has no state to go back to (describe() failed: %r)", path, exc)
        return None
    values = {item.key: item.tensor.detach().clone() if isinstance(item, TensorItem) else item.value for item in items}
    return ReadState(values, {item.key for item in items if isinstance(item, TensorItem)})


@contextmanager
def _naming(path: str) -> Iterator[None]:
    """Name the provider in a :class:`RestoreError` it raises, through every level of nesting."""
    try:
        yield
    except ChildRestoreError as exc:
        raise ChildRestoreError(f"{path}/{exc.path}", exc.reason) from exc
    except RestoreError as exc:
        raise ChildRestoreError(path, str(exc)) from exc
