"""The host-cache slabs one checkpoint holds, from capture to persist, each given back exactly once.

Capture takes a slab per chunk; compress may give it back early (its compressed copy is independent of
it); persist gives it back once written; the job gives back whatever is still held when the flow ends,
failed or not, and only after every worker thread has returned (stage_threads.py), so no thread
writes into a slab another checkpoint already took.
"""

from __future__ import annotations

import threading
import time

from ...tiers.storage.hostcache import HostCache, Slab
from ..metrics import CheckpointStats
from ..stage_threads import Flow, Stopped
from ..units import ChunkPlan


class HeldSlabs:
    """The slabs of one checkpoint's flow; ``lock`` is the job's (it also guards the stats)."""

    def __init__(self, cache: HostCache, flow: Flow, lock: threading.Lock, stats: CheckpointStats) -> None:
        self.cache = cache
        self.flow = flow
        self._lock = lock
        self._stats = stats
        self._held: set[Slab] = set()

    def take(self, plan: ChunkPlan) -> Slab:  # noqa: ARG002  # any slab of the cache holds any chunk
        """A free slab for ``plan``'s chunk, waiting while the cache is full (counted as ``cache_wait_s``); Stopped
        if the flow stops."""
        asked = time.monotonic()
        slab = self.cache.acquire(self.flow.stopped)
        if slab is None:
            raise Stopped
        got = time.monotonic()
        with self._lock:
            self._stats.cache_wait_s += got - asked
            self._held.add(slab)
        if got - asked > 1e-4:  # a wait worth a mark on the timeline (an uncontended take is ~us)
            self._stats.timeline.add("wait: host-cache slab", asked, got)
        return slab

    def give_back(self, slab: Slab) -> None:
        """``slab`` back to the cache, unless it was given back already."""
        with self._lock:
            if slab not in self._held:
                return
            self._held.discard(slab)
        self.cache.release(slab)

    def give_back_all(self) -> None:
        for slab in list(self._held):
            self.give_back(slab)
