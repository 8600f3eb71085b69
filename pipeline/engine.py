"""The machinery a runner's checkpoints run on: the host cache, the stage and I/O thread pools, and the
asyncio loop on a thread of its own that drives each checkpoint as a job.

Made once per runner and reused by every checkpoint: the cache is allocated (and pinned with CUDA)
once, so memory stays bounded and pinning is paid once; the pools are sized from the stage chain, one
thread per stage worker held for a checkpoint's whole flow (pipeline/stage_threads.py), since only one
checkpoint flows at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

import torch

from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.hostcache import HostCache
from .config import PipelineConfig
from .slotjob import slot_pool
from .stages.capture import SlabCopier


class Engine:
    """The cache, the slot pool of a memory tier captured into (``slots``), the pools (``compute`` for the
    stages, ``io`` for writes and commits) and the loop. ``tier``: the persist tier; ``rank``: this rank's."""

    def __init__(self, config: PipelineConfig, tier: FilesystemTier, rank: int) -> None:
        pinned = config.host_cache.pinned
        if pinned == "auto":
            pinned = torch.cuda.is_available()
        self.slab_size = max(4096, config.chunk_size // 4096 * 4096)
        compress = config.stage_of_kind("compress")
        scratch = config.threads_for("compress") if compress is not None and compress.codec != "none" else 0
        self.slots = slot_pool(config, tier, rank, pin=bool(pinned))
        # Captured into slots, tensor bytes never pass through the cache: it keeps its least (two slabs).
        size = config.host_cache.size if self.slots is None else 2 * self.slab_size
        self.cache = HostCache(size, self.slab_size, pinned=bool(pinned), scratch=scratch)
        # One thread per stage worker, and one for the feeder.
        stage_workers = sum(s.workers for _, s in config.chain() if s.kind != "persist") + 1
        self.compute = concurrent.futures.ThreadPoolExecutor(stage_workers, thread_name_prefix="tierstate-cpu")
        self.io = concurrent.futures.ThreadPoolExecutor(
            config.chain()[-1][1].workers + 1, thread_name_prefix="tierstate-io"
        )
        self.copier = SlabCopier()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tierstate-loop", daemon=True)
        self._thread.start()

    def start(self, work: Coroutine[Any, Any, object]) -> concurrent.futures.Future[object]:
        """Run ``work`` on the loop, from any other thread."""
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def stop(self) -> None:
        """Stop the loop and its thread, then the pools (their work is done: the runner drained first)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
        self.compute.shutdown()
        self.io.shutdown()
        if self.slots is not None:
            self.slots.close()
