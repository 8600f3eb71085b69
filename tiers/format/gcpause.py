"""Python's cyclic garbage collector held off while a checkpoint's metadata is built or parsed.

Reading or writing the manifest of 10^4-10^5 items allocates millions of small objects (dicts,
pydantic models, JSON strings), none of them garbage. Each burst of allocations triggers the cyclic
collector, and its oldest-generation passes traverse every object in the process (a trainer holds
millions) while holding the GIL, stalling the trainer's thread too. Measured on a 1000-tensor
restore: 30 ms with the collector paused, up to 230 ms with it running; 10^4 tensors 0.33 s
against 0.51 s. Reference counting frees everything as usual meanwhile; only reference cycles wait
until the outermost pause ends. CPython has one collector per process, so pauses from several
threads are counted, and the collector is re-enabled only if it was enabled when the first began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Pauses:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.resume = False


_pauses = _Pauses()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off cyclic garbage collection for the duration (nestable, from any thread)."""
    with _pauses.lock:
        if _pauses.depth == 0:
            _pauses.resume = gc.isenabled()
            gc.disable()
        _pauses.depth += 1
    try:
        yield
    finally:
        with _pauses.lock:
            _pauses.depth -= 1
            if _pauses.depth == 0 and _pauses.resume:
                gc.enable()
