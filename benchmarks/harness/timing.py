"""One checkpoint timed outside a training loop, and the untimed warm-up before any timing."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from .checkpointer import Checkpointer
from .disk import settle


@dataclass
class SaveTiming:
    """One checkpoint outside a training loop: when the call returned, the state was free, it was durable."""

    call_s: float
    staged_s: float  # from the request until the state may change: the worst case a trainer can block
    durable_s: float


def time_save(ckpt: Checkpointer, step: int) -> SaveTiming:
    """Checkpoint once and wait: the request-to-captured and request-to-durable times of ``ckpt``."""
    settle()
    record = ckpt.save(step)
    call_s = time.perf_counter() - record.requested
    ckpt.wait_staged()
    staged_s = time.perf_counter() - record.requested
    ckpt.drain()
    return SaveTiming(call_s, staged_s, time.perf_counter() - record.requested)


def warm_up(ckpts: Iterable[Checkpointer]) -> None:
    """One checkpoint per method before timing (allocations, stager caches, first-use imports), then forget it."""
    for ckpt in ckpts:
        ckpt.save(0)
        ckpt.drain()
        ckpt.clear()
        ckpt.records.clear()
