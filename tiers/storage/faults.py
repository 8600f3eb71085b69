"""Named fault points on the checkpoint path, for the fault-injection suite (tests/faults/).

The write path calls :func:`point` at the moments where a crash or a failing disk matters most
(capture, each frame write, the data fsync, commit before and after the rename, each frame a
migration or flush copies, a deletion by retention between unpublishing and removing). Outside the suite
every call is a no-op costing one dict lookup and one environment lookup. Two ways to act on one:

* ``TIERSTATE_FAULT=NAME@N`` in the environment SIGKILLs the process the N-th time (default 1st)
  NAME is reached, so a test can kill a real trainer process at an exact point of the protocol.
* :func:`inject` runs a callable there in-process, so a test can cause a real fault (remove the
  directory, fill the disk, remount it read-only) at a known moment instead of racing a timer.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "TIERSTATE_FAULT"
POINTS = (
    "begin",
    "capture",
    "persist.write",
    "persist.fsync",
    "commit.manifest",
    "commit.rename",
    "migrate.frame",
    "prune.delete",
    "s3.object",
    "s3.part",
)

Handler = Callable[[Path | None], None]

_handlers: dict[str, Handler] = {}
_hits: Counter[str] = Counter()
_lock = threading.Lock()


def point(name: str, path: Path | None = None) -> None:
    """Reached fault point ``name`` (``path``: the file or directory being worked on, if any)."""
    spec = os.environ.get(ENV)
    handler = _handlers.get(name)
    if spec is not None:
        target, _, nth = spec.partition("@")
        if target == name:
            with _lock:
                _hits[name] += 1
                due = _hits[name] == int(nth or 1)
            if due:
                os.kill(os.getpid(), signal.SIGKILL)
    if handler is not None:
        handler(path)


@contextmanager
def inject(name: str, handler: Handler) -> Iterator[None]:
    """Run ``handler(path)`` each time ``name`` is reached, until the block exits."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r} (points: {', '.join(POINTS)})")
    _handlers[name] = handler
    try:
        yield
    finally:
        del _handlers[name]
