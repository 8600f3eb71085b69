"""The stage coroutines and their bounded queues, driven directly on the test's event loop (pytest-asyncio).

No runner and no background thread: each test feeds a stage's inbox itself and reads its outbox, so
it can stop at the exact point where backpressure must hold (a full queue, a full host cache) and
look. Capture copies real tensors into real host-cache slabs; serialize really encodes objects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierstate.pipeline.capture import SlabCopier
from tierstate.pipeline.config import parse_config
from tierstate.pipeline.job import CheckpointJob, JobContext
from tierstate.pipeline.metrics import CheckpointStats
from tierstate.pipeline.plan import ChunkPlan, plan_checkpoint
from tierstate.pipeline.units import DONE, Chunk, ObjectBatch, run_blocking
from tierstate.providers import ObjectItem, TensorItem
from tierstate.tiers.filesystem import FilesystemTier
from tierstate.tiers.hostcache import HostCache
from tierstate.tiers.objcodec import decode_object

MiB = 1 << 20


@pytest.fixture
def pools() -> Iterator[tuple[concurrent.futures.Executor, concurrent.futures.Executor]]:
    compute = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-cpu")
    io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-io")
    yield compute, io
    compute.shutdown()
    io.shutdown()


def _job(tmp_path: Path, pools, items: list, cache_slabs: int = 2) -> tuple[CheckpointJob, HostCache]:
    """A job over ``items`` with a host cache of ``cache_slabs`` slabs of 1 MiB."""
    config = parse_config({"tiers": {"nvme": {"path": str(tmp_path)}}, "chunk_size": "1MiB",
                           "host_cache": {"size": cache_slabs * MiB}})  # fmt: skip
    cache = HostCache(config.host_cache.size, MiB, pinned=False)
    compute, io = pools
    ctx = JobContext(config, cache, FilesystemTier("nvme", tmp_path), compute, io, SlabCopier())
    return CheckpointJob(ctx, 1, plan_checkpoint(items, MiB), None, lambda: None, CheckpointStats(1)), cache


async def _fill(queue: asyncio.Queue, units: list) -> None:
    for unit in units:
        queue.put_nowait(unit)
    queue.put_nowait(DONE)


async def test_capture_waits_for_a_free_slab_when_the_host_cache_is_full(tmp_path, pools):
    tensors = [torch.arange(MiB // 4, dtype=torch.float32) + i for i in range(3)]
    job, cache = _job(tmp_path, pools, [TensorItem(f"t{i}", t) for i, t in enumerate(tensors)])
    assert len(job.plan.chunks) == 3 and cache.slab_count == 2
    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    await _fill(inbox, job.plan.chunks)
    stage = asyncio.create_task(job._stage("capture", 1, job._capture, inbox, outbox, "serialize"))

    first, second = await outbox.get(), await outbox.get()
    # The worker went straight on to the third chunk and is now waiting for a slab: nothing more comes out.
    assert cache.waits == 1 and cache.in_use == 2
    assert outbox.empty() and not stage.done()
    assert bytes(first.raw) == tensors[0].numpy().tobytes() and bytes(second.raw) == tensors[1].numpy().tobytes()

    job._release(first.slab)  # persist is done with the first chunk
    third = await outbox.get()
    assert third.slab is first.slab and bytes(third.raw) == tensors[2].numpy().tobytes()  # the freed slab, reused
    assert await outbox.get() is DONE
    await stage
    assert cache.peak_in_use == 2


async def test_serialize_encodes_the_objects_and_passes_tensor_chunks_on(tmp_path, pools):
    job, _ = _job(tmp_path, pools, [ObjectItem("meta", {"epoch": 2}), ObjectItem("note", "hi", serializer="json")])
    tensor_chunk = Chunk(entries=[], raw=memoryview(b"raw tensor bytes"))
    inbox, outbox = asyncio.Queue(maxsize=4), asyncio.Queue()
    await _fill(inbox, [ObjectBatch(job.plan.objects), tensor_chunk])
    await job._stage("serialize", 2, job._serialize, inbox, outbox, "compress")

    out = [outbox.get_nowait() for _ in range(outbox.qsize())]
    assert out[-1] is DONE and DONE not in out[:-1]  # both workers stopped, one end marker passed on
    assert tensor_chunk in out
    [objects] = [unit for unit in out[:-1] if unit is not tensor_chunk]
    decoded = {e.key: bytes(objects.raw[e.chunk_offset : e.chunk_offset + e.length]) for e in objects.entries}
    assert decode_object(decoded["meta"], "msgpack") == {"epoch": 2}
    assert decode_object(decoded["note"], "json") == "hi"


async def test_the_feeder_waits_while_the_first_queue_is_full(tmp_path, pools):
    tensors = [torch.full((MiB // 8,), float(i)) for i in range(5)]  # half a MiB each: 3 chunks
    job, _ = _job(tmp_path, pools, [TensorItem(f"t{i}", t) for i, t in enumerate(tensors)])
    chunks = len(job.plan.chunks)
    assert chunks == 3
    queue: asyncio.Queue = asyncio.Queue(maxsize=2)
    feeder = asyncio.create_task(job._feed(queue, "capture"))
    await asyncio.sleep(0)  # the feeder runs until the bound stops it (puts into a queue with room never yield)
    assert queue.qsize() == 2 and not feeder.done()
    received = []
    while not received or received[-1] is not DONE:
        received.append(await queue.get())
    await feeder
    assert received[:-1] == job.plan.chunks and isinstance(received[0], ChunkPlan)
    assert job.stats.queue_peaks["capture"] == 2


async def test_a_cancelled_blocking_call_still_waits_for_its_thread(pools):
    """Cancelling must not unwind while the thread still writes into a slab the caller would release."""
    started, gate = threading.Event(), threading.Event()

    def work() -> str:
        started.set()
        gate.wait(30)
        return "done"

    call = asyncio.create_task(run_blocking(pools[0], work))
    await asyncio.to_thread(started.wait, 30)
    call.cancel()
    finished, _ = await asyncio.wait([call], timeout=0.2)
    assert not finished  # still waiting for the thread
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await call
