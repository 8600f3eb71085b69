"""A runner's life in its process: drained at interpreter exit when the trainer forgets ``close()``, and
disowned in a forked child, which inherits a copy of it but none of its threads.

In the child the copy is closed at once (``os.register_at_fork``), so the child neither drains it at
exit nor waits on a loop that does not run there, and leaves the parent's checkpoint files alone;
only the parent drains.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol

from tierstate.errors import TierstateError


class RunnerClosedError(TierstateError, RuntimeError):
    """A runner that is closed, or that a forked child inherited, was asked to do something."""


def closed_reason(owner_pid: int) -> str:
    """Why a closed runner made by process ``owner_pid`` refuses a call, and what to do instead."""
    if os.getpid() != owner_pid:
        return (
            f"runner of process {owner_pid} is closed in its forked child {os.getpid()}: "
            "only the process that made a runner checkpoints through it"
        )
    return (
        "this runner is closed (close() was called, or its with-block ended): it checkpoints, registers and "
        "restores no more; build a new one (Runner.from_yaml(...)) to go on: it restores from the same tiers"
    )


class Owned(Protocol):
    """What this module needs of a runner."""

    def close(self) -> None: ...

    def disown(self) -> None: ...


# Every live runner, so that a forked child can close its copies.
_RUNNERS: weakref.WeakSet[Owned] = weakref.WeakSet()


def adopt(runner: Owned) -> None:
    """Close ``runner`` at interpreter exit unless it was closed before, and disown it in a forked child.

    Not atexit.register: at interpreter exit the thread pools refuse new work before atexit handlers
    run, so a drain from there fails the checkpoint in flight. Threading's own exit hooks run earlier,
    newest first, so this one runs before the pools shut down. No public API runs a hook at that
    moment, hence threading's private one.
    """
    threading._register_atexit(_close_at_exit, weakref.ref(runner))    # pyright: ignore[reportAttributeAccessIssue]  # noqa: SLF001
    _RUNNERS.add(runner)


def _disown_after_fork() -> None:
    for runner in list(_RUNNERS):
        runner.disown()


os.register_at_fork(after_in_child=_disown_after_fork)


def _close_at_exit(ref: weakref.ref[Owned]) -> None:
    """A trainer that forgets close() still gets its last requested checkpoint made durable."""
    runner = ref()
    if runner is not None:
        runner.close()
