"""Storage calls that name what failed, and retry transient errors with backoff when the YAML says so.

A bare ``OSError: [Errno 5] Input/output error`` from an fsync says neither which tier nor which
file, so every storage call of a checkpoint goes through :func:`storage_call`, which turns an
OSError into a :class:`~tiers.storage.filesystem.TierError` that keeps the errno and names the operation
(and where in the file, when the writer added that as a note to the error).

Only writes that put all their bytes at a fixed place again are retried (a chunk written again
goes to the frames it was given the first time, see :mod:`tiers.format.container`; the index goes via a
temporary file and a rename): repeating them cannot leave a mix of old and new bytes. An fsync
or the commit is never retried: after a failed fsync Linux may mark the lost pages clean, so a
second fsync can succeed although the data never reached the disk; the checkpoint fails instead
and the previous one stays.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..tiers.storage.filesystem import TierError
from .units import run_blocking

T = TypeVar("T")
log = logging.getLogger("tierstate")

# Errors a retry can outlive: space freed by retention or another job, a network file system's
# transient I/O error or timeout, a busy device.
TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ENOBUFS}
)


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a storage error a retry can outlive (see TRANSIENT_ERRNOS)."""
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more attempts after the first, waiting ``backoff`` seconds before the first, doubling."""

    retries: int = 0
    backoff: float = 0.5

    def delay(self, retry: int) -> float:
        return self.backoff * 2**retry


async def storage_call(
    pool: concurrent.futures.Executor,
    what: str,
    fn: Callable[..., T],
    *args: Any,
    retry: RetryPolicy | None = None,
) -> T:
    """``fn(*args)`` in ``pool``; an OSError becomes a TierError saying ``what``; transient ones are
    retried under ``retry`` (None: never, for calls that are unsafe to repeat)."""
    retries = 0
    while True:
        try:
            return await run_blocking(pool, fn, *args)
        except TierError:
            raise  # already says which tier and path
        except OSError as exc:
            delay = _backoff(what, exc, retry, retries)
            retries += 1
            await asyncio.sleep(delay)


def storage_call_here(
    what: str,
    fn: Callable[..., T],
    *args: Any,
    retry: RetryPolicy | None = None,
    sleep: Callable[[float], None],
) -> T:
    """:func:`storage_call` on this (stage worker) thread; ``sleep`` waits out a backoff (the flow's, which a
    failure elsewhere ends early)."""
    retries = 0
    while True:
        try:
            return fn(*args)
        except TierError:
            raise
        except OSError as exc:
            delay = _backoff(what, exc, retry, retries)
            retries += 1
            sleep(delay)


def _backoff(what: str, exc: OSError, retry: RetryPolicy | None, retries: int) -> float:
    """The seconds to wait before retrying after ``retries`` retries failed with ``exc``; raises the
    TierError that names ``what`` when the call is not to be retried (again)."""
    where = " ".join([what, *getattr(exc, "__notes__", ())])  # a writer's note: where in the file
    if retry is None or not transient(exc) or retries >= retry.retries:
        after = f" (after {retries} {'retry' if retries == 1 else 'retries'})" if retries else ""
        message = f"{where}: {exc.strerror or exc}{after}"
        raise (TierError(exc.errno, message) if exc.errno else TierError(message)) from exc
    delay = retry.delay(retries)
    log.warning("%s: %s; retry %d of %d in %.2f s", where, exc.strerror, retries + 1, retry.retries, delay)
    return delay
