"""What goes on after a checkpoint commits: the one protocol the runner's listeners implement.

The runner commits a checkpoint on its persist tier, then hands it to each listener: the flusher
(pipeline/flush.py: copies along the flush graph to slower tiers and buckets, and retention) and,
with ``replicas: 1``, the peer link (pipeline/peers.py: a node's part to its partner node). A node
agent that flushes out of shared memory is one more listener of the same shape. The runner knows
them only through this protocol, as DCP's ``AsyncStager`` is known to ``async_save``.

Call order, for every listener:

1. ``committed(completer)``, on the runner's event loop, once for each checkpoint that committed, in
   commit order (the same order on every rank). It starts work and returns at once; what it reports
   goes through ``completer`` (a tier's future resolving, a flush error on the handle).
2. ``drain()``, from the trainer's thread (never the loop's), after the last checkpoint: waits for
   everything started and returns what failed for good; never raises.
3. ``close()``, once, after ``drain()``: releases threads and groups.
"""

from __future__ import annotations

from typing import Protocol

from .flush import FlushFailure
from .handle import HandleCompleter


class AfterCommit(Protocol):
    """A listener of committed checkpoints; see the module docstring for the call order."""

    def committed(self, completer: HandleCompleter) -> None: ...

    def drain(self) -> list[FlushFailure]: ...

    def close(self) -> None: ...
