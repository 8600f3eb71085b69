"""The stage workers and their bounded hand-offs, driven directly from the test (no runner).

Each test starts a stage's workers on threads, feeds their inbox itself and reads their outbox, so it
can stop at the exact point where backpressure must hold (a full queue, a full host cache) and look.
Capture copies real tensors into real host-cache slabs; serialize really encodes objects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tierstate.pipeline.config import parse_config
from tierstate.pipeline.lanes import Lane, Step, feed, run_lane
from tierstate.pipeline.metrics import CheckpointStats, StageStats
from tierstate.pipeline.plan import CheckpointPlan, plan_checkpoint
from tierstate.pipeline.stage_threads import Flow, Handoff, Stopped, run_workers
from tierstate.pipeline.stages.capture import Capture, SlabCopier
from tierstate.pipeline.stages.persist import Persist, TierWriter
from tierstate.pipeline.stages.serialize import Serialize
from tierstate.pipeline.stages.slabs import HeldSlabs
from tierstate.pipeline.units import Chunk, ChunkPlan, ObjectBatch, Unit, run_blocking
from tierstate.providers import ObjectItem, TensorItem
from tierstate.tiers.format.objcodec import decode_object
from tierstate.tiers.storage.hostcache import HostCache

MiB = 1 << 20


@pytest.fixture
def pools() -> Iterator[tuple[concurrent.futures.Executor, concurrent.futures.Executor]]:
    compute = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-cpu")
    io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-io")
    yield compute, io
    compute.shutdown()
    io.shutdown()


class Flowing:
    """What the stages of one checkpoint share: its flow, lock and stats, and the slabs it holds in a host
    cache of ``cache_slabs`` slabs of 1 MiB; ``plan``: the items planned in chunks of 1 MiB."""

    def __init__(self, items: list, cache_slabs: int = 2) -> None:
        self.plan: CheckpointPlan = plan_checkpoint(items, MiB)
        self.cache = HostCache(cache_slabs * MiB, MiB, pinned=False)
        self.flow, self.lock, self.stats = Flow(), threading.Lock(), CheckpointStats(1)
        self.slabs = HeldSlabs(self.cache, self.flow, self.lock, self.stats)

    def capture(self) -> Capture:
        return Capture(self.slabs, SlabCopier(), None, None, True, len(self.plan.chunks), lambda: None, self.lock)


def _until(predicate, what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` (a state another thread reaches without telling anyone) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def _filled(flow: Flow, units: list) -> Handoff:
    queue = Handoff(len(units) + 1, flow)
    for unit in units:
        queue.put(unit)
    queue.close()
    return queue


class Keep:
    """A stage that hands every unit on as it is: the lane a test only reads from."""

    def passes(self, unit: Unit) -> bool:
        return False

    def run(self, unit: Unit) -> Unit:
        return unit


def _lane(stats: StageStats, stage, inbox: Handoff) -> Lane:
    """One worker's lane running ``stage`` on every unit."""
    return Lane([Step(stats, stage)], 1, inbox)


def test_capture_waits_for_a_free_slab_when_the_host_cache_is_full():
    tensors = [torch.arange(MiB // 4, dtype=torch.float32) + i for i in range(3)]
    job = Flowing([TensorItem(f"t{i}", t) for i, t in enumerate(tensors)])
    cache = job.cache
    assert len(job.plan.chunks) == 3 and cache.slab_count == 2
    flow = job.flow
    inbox, outbox = _filled(flow, job.plan.chunks), Handoff(8, flow)
    stats = StageStats()
    lanes = [_lane(stats, job.capture(), inbox), _lane(StageStats(), Keep(), outbox)]
    worker = _thread(run_lane, lanes, 0, job.lock, [1])

    first, second = outbox.get(), outbox.get()
    # The worker went straight on to the third chunk and is now waiting for a slab: nothing more comes out.
    _until(lambda: cache.waits == 1, "capture to wait for a slab")
    assert cache.in_use == 2 and worker.is_alive()
    assert bytes(first.raw) == tensors[0].numpy().tobytes() and bytes(second.raw) == tensors[1].numpy().tobytes()

    job.slabs.give_back(first.slab)  # persist is done with the first chunk
    third = outbox.get()
    assert third.slab is first.slab and bytes(third.raw) == tensors[2].numpy().tobytes()  # the freed slab, reused
    assert outbox.get() is None  # the stage's last worker closed its outbox
    worker.join(30)
    assert cache.peak_in_use == 2 and stats.units == 3


def test_serialize_encodes_the_objects_and_passes_tensor_chunks_on():
    job = Flowing([ObjectItem("meta", {"epoch": 2}), ObjectItem("note", "hi", serializer="json")])
    tensor_chunk = Chunk(entries=[], raw=memoryview(b"raw tensor bytes"))
    flow = job.flow
    inbox, outbox = _filled(flow, [ObjectBatch(job.plan.objects), tensor_chunk]), Handoff(8, flow)
    stats = StageStats()
    serialize = Lane([Step(stats, Serialize(allow_pickle=False))], 2, inbox)
    lanes, left = [serialize, _lane(StageStats(), Keep(), outbox)], [2]
    for worker in [_thread(run_lane, lanes, 0, job.lock, left) for _ in range(2)]:
        worker.join(30)

    out = []
    while (unit := outbox.get()) is not None:  # closed once, by the last of the two workers
        out.append(unit)
    assert tensor_chunk in out and len(out) == 2 and left == [0]
    assert (stats.units, stats.passed_units) == (2, 1)  # the tensor chunk went past, never encoded
    [objects] = [unit for unit in out if unit is not tensor_chunk]
    decoded = {e.key: bytes(objects.raw[e.chunk_offset : e.chunk_offset + e.length]) for e in objects.entries}
    assert decode_object(decoded["meta"], "msgpack") == {"epoch": 2}
    assert decode_object(decoded["note"], "json") == "hi"


def test_the_feeder_waits_while_the_first_queue_is_full():
    tensors = [torch.full((MiB // 8,), float(i)) for i in range(5)]  # half a MiB each: 3 chunks
    job = Flowing([TensorItem(f"t{i}", t) for i, t in enumerate(tensors)])
    assert len(job.plan.chunks) == 3
    queue = Handoff(2, job.flow)
    feeder = _thread(feed, job.plan.chunks, queue)
    _until(lambda: queue.peak == 2, "the feeder to fill the queue")
    assert feeder.is_alive()  # blocked on the third put until a unit is taken
    received = []
    while (unit := queue.get()) is not None:
        received.append(unit)
    feeder.join(30)
    assert received == job.plan.chunks and isinstance(received[0], ChunkPlan) and queue.peak == 2


async def test_a_failing_worker_stops_the_flow_and_its_error_is_raised(pools):
    """The other workers end their waits (an empty queue, a full one, the host cache) instead of hanging."""
    flow = Flow()
    cache = HostCache(2 * MiB, MiB, pinned=False)
    flow.on_stop(cache.wake)
    empty, full = Handoff(1, flow), Handoff(1, flow)
    full.put("unit")
    held = [cache.acquire(flow.stopped), cache.acquire(flow.stopped)]
    assert None not in held
    blocked = threading.Barrier(4)

    def waits(fn) -> None:
        blocked.wait(30)
        fn()

    def fails() -> None:
        blocked.wait(30)
        raise OSError(28, "No space left on device")

    calls = [(pools[0], waits, (empty.get,)), (pools[0], waits, (lambda: full.put("more"),)),
             (pools[1], waits, (lambda: cache.acquire(flow.stopped),)), (pools[1], fails, ())]  # fmt: skip
    with pytest.raises(OSError, match="No space left"):
        await asyncio.wait_for(run_workers(flow, calls), 60)
    assert flow.stopped.is_set() and cache.acquire(flow.stopped) is None
    with pytest.raises(Stopped):
        flow.sleep(60)  # a backoff in a stopped flow ends at once


async def test_a_cancelled_flow_stops_its_workers_and_waits_for_them(pools):
    flow = Flow()
    queue = Handoff(1, flow)
    started = threading.Event()

    def worker() -> None:
        started.set()
        queue.get()  # nothing ever comes: only the stop ends this

    run = asyncio.create_task(run_workers(flow, [(pools[0], worker, ())]))
    await asyncio.to_thread(started.wait, 30)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 60)
    assert flow.stopped.is_set() and isinstance(flow.error, asyncio.CancelledError)


class _CountingLoop(asyncio.SelectorEventLoop):
    """A loop that counts how often other threads wake it."""

    wakeups = 0

    def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[override]
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def test_the_loop_is_woken_once_for_all_the_workers_of_a_flow(pools):
    """Each wake-up of the loop is a thread taking the GIL from the trainer: a flow's 6 workers wake it once."""
    flow = Flow()
    queue = Handoff(8, flow)
    got: list[int] = []

    def consume() -> None:
        while (unit := queue.get()) is not None:
            with flow.lock:
                got.append(unit)

    calls = [(pools[0], feed, (list(range(20)), queue))] + [(pools[i % 2], consume, ()) for i in range(5)]
    loop = _CountingLoop()
    try:
        loop.run_until_complete(run_workers(flow, calls))
    finally:
        loop.close()
    assert sorted(got) == list(range(20))
    assert loop.wakeups == 1


async def test_a_flow_without_workers_returns_at_once():
    await asyncio.wait_for(run_workers(Flow(), []), 60)


async def test_a_pool_that_refuses_a_worker_stops_the_flow_and_raises(pools):
    """A worker that cannot start (its pool shut down) must not leave the started ones waiting for it."""
    flow = Flow()
    queue = Handoff(1, flow)
    closed = concurrent.futures.ThreadPoolExecutor(1)
    closed.shutdown()
    calls = [(pools[0], queue.get, ()), (closed, queue.close, ())]  # the close never runs: get waits for it
    with pytest.raises(RuntimeError, match="shutdown"):
        await asyncio.wait_for(run_workers(flow, calls), 60)
    assert flow.stopped.is_set()


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


async def test_persist_fails_a_unit_that_is_not_a_chunk_instead_of_dropping_it(tmp_path, pools):
    """A unit no stage turned into a chunk would be missing from the checkpoint: the checkpoint fails instead."""
    config = parse_config({"tiers": {"nvme": {"path": str(tmp_path)}}})
    job = Flowing([ObjectItem("meta", {"epoch": 2})])
    stage = config.stage_of_kind("persist")
    assert stage is not None
    writer = await TierWriter.open("nvme", tmp_path, 0, 1, job.plan, stage, config.align, pools[1])
    try:
        persist = Persist(writer, job.slabs, job.stats, job.lock)
        with pytest.raises(TypeError, match="ObjectBatch reached persist"):
            persist.run(ObjectBatch(job.plan.objects))
        assert job.stats.chunks == 0
    finally:
        writer.close()


def test_a_reused_chunk_plan_keeps_its_copy_program_and_copies_the_current_bytes() -> None:
    """Without eager sources (the memory tier's captures) a reused plan's copy program, and the views of its
    tensors it keeps, are worked out once; each copy still takes the bytes the tensors hold then, and a
    tensor given other memory is copied from that."""
    weight = torch.arange(1024, dtype=torch.float32)
    plan = plan_checkpoint([TensorItem("w", weight)], MiB).chunks[0]
    cache = HostCache(2 * MiB, MiB, pinned=False)
    copier = SlabCopier()
    copied = []
    for fill in (1.0, 2.0, 3.0):
        if fill == 3.0:
            weight.data = torch.full((1024,), 3.0)  # the same tensor object, other memory
        else:
            weight.fill_(fill)
        slab = cache.acquire(threading.Event())
        assert slab is not None
        chunk = copier.copy(plan, slab, None)
        copied.append((plan.program, bytes(chunk.raw[:4096])))
        cache.release(slab)
    assert copied[0][0] is copied[1][0] is copied[2][0]
    for (_, raw), fill in zip(copied, (1.0, 2.0, 3.0), strict=True):
        assert raw == torch.full((1024,), fill).numpy().tobytes()
