"""CPU seconds per thread of this process, grouped by the thread's Python name, to see where a
checkpoint's core-seconds go (capture, I/O, the event loop) while the trainer's own are left out."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping

_POOL_SUFFIX = re.compile(r"_\d+$")  # ThreadPoolExecutor names its threads <prefix>_<n>


def _on_cpu_s(tid: int) -> float:
    """Seconds thread ``tid`` has run on a CPU, from ``/proc/self/task/<tid>/schedstat`` (nanoseconds,
    not the 10 ms ticks of ``stat``); 0 for a thread that has exited."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def thread_names() -> dict[int, str]:
    """Native thread id -> Python thread name, pool threads by their prefix (``tierstate-io``)."""
    return {t.native_id: _POOL_SUFFIX.sub("", t.name) for t in threading.enumerate() if t.native_id is not None}


def cpu_by_thread() -> dict[int, float]:
    """Every live thread's on-CPU seconds so far, by native id."""
    return {int(tid): _on_cpu_s(int(tid)) for tid in os.listdir("/proc/self/task")}


def cpu_delta_by_name(before: Mapping[int, float], after: Mapping[int, float]) -> dict[str, float]:
    """On-CPU seconds spent between two :func:`cpu_by_thread` snapshots, summed per thread name
    (threads Python does not know, such as OpenMP's, as ``native``)."""
    names = thread_names()
    names[threading.main_thread().native_id or 0] = "trainer (main)"
    spent: dict[str, float] = {}
    for tid, seconds in after.items():
        name = names.get(tid, "native")
        spent[name] = spent.get(name, 0.0) + seconds - before.get(tid, 0.0)
    return spent
