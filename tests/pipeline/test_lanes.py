"""Stages with ``workers: 0`` run on the threads of the stage before them (pipeline/lanes.py).

Real runners write real checkpoints; the fault points on the write path (capture, each frame write)
record which thread reached them, so the tests see where each stage ran, not only what it wrote.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from tierstate import Runner
from tierstate.pipeline.config import parse_config
from tierstate.providers import ObjectProvider, TensorDictProvider
from tierstate.tiers.storage import faults

MiB = 1 << 20
ONE_THREAD = {f"pipeline.stages.{name}.workers": 0 for name in ("serialize", "compress", "persist")}


@contextmanager
def _threads_at(*points: str) -> Iterator[list[tuple[str, str]]]:
    """(fault point, name of the thread that reached it), in the order they were reached."""
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def record(point: str) -> Callable[[Path | None], None]:
        def handler(_: Path | None) -> None:
            with lock:
                seen.append((point, threading.current_thread().name))
        return handler

    with ExitStack() as stack:
        for point in points:
            stack.enter_context(faults.inject(point, record(point)))
        yield seen


def _tensors() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.arange(MiB // 4, dtype=torch.float32) * (i + 1) for i in range(6)}


def _restored_equal(runner: Runner, step: int, tensors: dict[str, torch.Tensor]) -> bool:
    expected = {k: v.clone() for k, v in tensors.items()}
    for t in tensors.values():
        t.zero_()
    runner.restore(step)
    return all(torch.equal(tensors[k], expected[k]) for k in tensors)


def test_with_workers_0_the_thread_that_captured_a_chunk_writes_it(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner(chunk_size="1MiB", **ONE_THREAD, **{"pipeline.stages.capture.workers": 1})
    tensors = _tensors()
    runner.register(t=TensorDictProvider(tensors), meta=ObjectProvider({"epoch": 3}))
    with _threads_at("capture", "persist.write") as seen:
        handle = runner.checkpoint(1)
        handle.result()
    captured = [name for point, name in seen if point == "capture"]
    written = [name for point, name in seen if point == "persist.write"]
    assert len(captured) == 6 and len(written) == 7  # six tensor chunks and the objects' chunk
    assert len(set(captured)) == 1 and set(written) == set(captured)  # one thread, nothing handed over
    assert captured[0].startswith("tierstate-cpu")
    # Each chunk is written before the next one is captured: the thread runs one chunk end to end.
    order = [point for point, _ in seen]
    assert all(order[i + 1] == "persist.write" for i, point in enumerate(order[:-1]) if point == "capture")
    stages = handle.stats.stages
    assert (stages["serialize"].units, stages["serialize"].passed_units) == (7, 6)  # it encoded the objects
    assert (stages["compress"].passed_units, stages["persist"].units) == (7, 7)
    assert _restored_equal(runner, 1, tensors)


def test_by_default_persist_writes_on_its_own_threads(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner(chunk_size="1MiB")
    tensors = _tensors()
    runner.register(t=TensorDictProvider(tensors))
    with _threads_at("capture", "persist.write") as seen:
        runner.checkpoint(1).result()
    captured = {name for point, name in seen if point == "capture"}
    written = {name for point, name in seen if point == "persist.write"}
    assert written and all(name.startswith("tierstate-io") for name in written) and not captured & written


def test_compress_with_workers_0_compresses_on_the_serialize_threads(make_runner: Callable[..., Runner]) -> None:
    settings = {"pipeline.stages.compress.codec": "zstd", "pipeline.stages.compress.workers": 0}
    runner = make_runner(chunk_size="1MiB", **settings)
    tensors = {f"z{i}": torch.zeros(MiB // 4) for i in range(4)}  # compressible
    runner.register(t=TensorDictProvider(tensors))
    assert runner.cache.scratch_count == 1  # one scratch slab per thread that may compress: serialize's one
    handle = runner.checkpoint(1)
    result = handle.result()
    assert result.stored_bytes < result.raw_bytes // 10
    compress = handle.stats.stages["compress"]
    assert (compress.units, compress.passed_units, compress.queue_bound) == (4, 0, 0)  # no queue of its own
    tensors["z0"].fill_(1.0)
    runner.restore(1)
    assert all(bool((t == 0).all()) for t in tensors.values())


def test_threads_for_a_stage_without_workers_are_those_before_it() -> None:
    stages = {
        "capture": {"kind": "capture", "workers": 2, "next": "serialize"},
        "serialize": {"kind": "serialize", "workers": 0, "next": "compress"},
        "compress": {"kind": "compress", "workers": 3, "next": "persist", "codec": "none"},
        "persist": {"kind": "persist", "workers": 0, "tier": "nvme"},
    }
    config = parse_config({"tiers": {"nvme": {"path": "/tmp/unused"}}, "pipeline": {"stages": stages}})
    assert [config.threads_for(kind) for kind in ("capture", "serialize", "compress", "persist")] == [2, 2, 3, 3]
