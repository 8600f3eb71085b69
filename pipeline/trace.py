"""A checkpoint's work where profilers look: marks for torch.profiler and NVTX, and its timeline as a
Chrome/Perfetto trace.

Each unit a stage works on runs inside ``torch.profiler.record_function("tierstate/<stage>")`` (and an
NVTX range on CUDA, for Nsight Systems), so a torch profile of training shows the pipeline's threads
beside the step. The timeline every checkpoint keeps in its manifest (pipeline/metrics.py ``Timeline``:
stage work per thread, host-cache waits, the trainer's blocked time) becomes a trace that opens in
``ui.perfetto.dev`` or ``chrome://tracing``: ``tierstate stats PATH --trace trace.json``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import torch

from ..tiers.format.manifest import Manifest

P = ParamSpec("P")
R = TypeVar("R")


@functools.cache
def _nvtx() -> bool:
    return torch.cuda.is_available()


@contextmanager
def marked(stage: str) -> Iterator[None]:
    """The work inside, named ``tierstate/<stage>`` for torch.profiler (and NVTX on CUDA).

    Only where a torch profiler records this thread: a profiler records the thread that started it, and
    a ``record_function`` elsewhere is a dispatched op that records nothing, yet gives up and takes back
    the GIL. Measured beside the medium GPT's training: a checkpoint's 13 marks took the pipeline's threads
    7.8 ms, mostly waiting to get the GIL back from the trainer, and 0.4 ms once skipped."""
    name = f"tierstate/{stage}"
    with contextlib.ExitStack() as stack:
        # What record_function's own callbacks check, for this thread; there is no public view of it.
        if torch.autograd._profiler_enabled():  # pyright: ignore[reportPrivateImportUsage]  # noqa: SLF001
            stack.enter_context(torch.profiler.record_function(name))
        if _nvtx():
            torch.cuda.nvtx.range_push(name)
            stack.callback(torch.cuda.nvtx.range_pop)
        yield


def marks(stage: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A function whose every call is :func:`marked` ``stage``: the trainer's own calls into tierstate
    (``checkpoint()``, the optimizer pre-hook's wait), which a torch profile of the training thread shows
    beside the step (the torch profiler on a CPU records the thread that started it)."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            with marked(stage):
                return function(*args, **kwargs)

        return call

    return decorate


def chrome_trace(manifest: Manifest) -> dict[str, Any]:
    """The manifest's timelines in the Trace Event Format: one process per rank, one track per thread,
    a complete event per interval (an instant one for a unit a stage passed on), microseconds from the
    request."""
    events: list[dict[str, Any]] = []
    for rank, record in sorted((manifest.stats or {}).items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        threads = sorted({event.thread for event in record.timeline})
        for tid, thread in enumerate(threads):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": thread}})
        tids = {thread: tid for tid, thread in enumerate(threads)}
        for event in record.timeline:
            common = {"name": event.name, "pid": rank, "tid": tids[event.thread], "ts": event.start * 1e6}
            common["args"] = {"bytes": event.bytes}
            if event.end > event.start:
                events.append({**common, "ph": "X", "dur": (event.end - event.start) * 1e6})
            else:
                events.append({**common, "ph": "i", "s": "t"})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"step": manifest.step}}
