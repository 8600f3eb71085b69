"""One open runner per tier directory in a process, the second refused when it is built.

Two runners of one process writing one tier (a notebook cell that builds the runner, run twice) would
commit over each other. The tier's writer lock (tiers/storage/locks.py) refuses the second runner's tier, but
only once it writes there: at its first checkpoint, in the background, as a failed handle. So the
runner registers the tiers it writes here when it is built, and a second runner on one of them is
refused then, naming the first (where it was built) and how to let it go: ``close()``. A closed runner
holds nothing, nor does a forked child's copy of one (it is closed at the fork, pipeline/runner.py).

A tier is its directory (device and inode), whichever path names it. Other processes are the writer
lock's business: a second job on the tier is told at its first checkpoint, as before.
"""

from __future__ import annotations

import errno
import inspect
import os
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from ..tiers.storage.filesystem import TierInUseError


class Holder(Protocol):
    """What a runner shows of itself here: whether it holds its tiers (not once closed, nor while it is
    being built: one whose construction failed holds nothing), and how to name it."""

    @property
    def closed(self) -> bool: ...

    def __repr__(self) -> str: ...


class TierHeldError(TierInUseError):
    """A runner was built on a tier another open runner of this process writes; ``holder`` is that runner
    (``error.holder.close()`` lets the tier go where the first runner's name is lost, as in a notebook)."""

    def __init__(self, message: str, holder: Holder) -> None:
        super().__init__(errno.EBUSY, message)
        self.holder = holder


_held: weakref.WeakKeyDictionary[Holder, dict[tuple[int, int], tuple[str, Path]]] = weakref.WeakKeyDictionary()
_guard = threading.Lock()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:  # not there (a tier only read): nothing to hold
        return None
    return stat.st_dev, stat.st_ino


def hold(runner: Holder, tiers: Iterable[tuple[str, Path]]) -> None:
    """Register the tiers (name, directory) ``runner`` writes; TierHeldError naming the other runner if an open
    runner of this process writes one of them already."""
    wanted = {key: (name, path) for name, path in tiers if (key := _identity(path)) is not None}
    with _guard:
        for other, held in list(_held.items()):
            if other is runner or other.closed:
                continue
            for key, (name, path) in wanted.items():
                if key in held:
                    raise TierHeldError(
                        f"tier {name} ({path}) is written by another open runner of this process, {other!r}; "
                        "close that one first (runner.close(), or build runners in a `with` block; it is this "
                        "error's .holder), or give this one a tier of its own",
                        other,
                    )
        _held[runner] = wanted


def built_at() -> str:
    """Where the caller's caller outside tierstate is (``train.py:12``): the line that built a runner,
    through an integration too (a Trainer's callback), for a message naming that runner."""
    frame = inspect.currentframe()
    while frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "tierstate":
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
