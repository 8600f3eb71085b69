"""Small durable files from the event loop: the runner's executor hop against aiofiles (DESIGN.md).

A checkpoint writes its index (msgpack, a few KiB to about 1 MiB for 10^4 tensors) from the event
loop, durably: a temporary file, fsync, rename. Verification stamps (about 150 bytes) are the
same shape. This measures, per file, the latency of each way to do that without blocking the
loop, and how late a 1 ms ticker on the same loop runs meanwhile (the loop's lag):

- ``executor``: ``write_durably`` as one call in a thread pool, as the runner does (``run_blocking``);
- ``aiofiles``: ``aiofiles.open`` / ``write`` / ``flush``, fsync through the loop's executor (aiofiles
  has none), ``aiofiles.os.replace``: each step its own trip to a thread;
- ``on the loop``: ``write_durably`` called directly, for scale (what not to do).

Run: ``python benchmarks/small_files.py [--dir DIR] [--files N]`` (needs ``pip install aiofiles``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiofiles
import aiofiles.os

from tierstate.pipeline.units import run_blocking
from tierstate.tiers.format import write_durably

SIZES = {"stamp, 150 B": 150, "index, 64 KiB": 64 << 10, "index, 1 MiB": 1 << 20}


async def _aiofiles_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    async with aiofiles.open(tmp, "wb") as handle:
        await handle.write(data)
        await handle.flush()
        await asyncio.get_running_loop().run_in_executor(None, os.fsync, handle.fileno())
    await aiofiles.os.replace(tmp, path)


async def _lag_ticker(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        due = time.perf_counter() + 0.001
        await asyncio.sleep(0.001)
        lags.append(max(0.0, time.perf_counter() - due))


async def _measure(
    write: Callable[[Path, bytes], Awaitable[None]], directory: Path, data: bytes, files: int
) -> tuple[float, float]:
    lags: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_lag_ticker(stop, lags))
    latencies = []
    for i in range(files):
        started = time.perf_counter()
        await write(directory / f"f{i}", data)
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0)  # let the ticker run between files, as other tasks would
    stop.set()
    await ticker
    return statistics.median(latencies), max(lags, default=0.0)


async def main(directory: Path, files: int) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(2)

    async def executor(path: Path, data: bytes) -> None:
        await run_blocking(pool, write_durably, path, data)

    async def on_the_loop(path: Path, data: bytes) -> None:
        write_durably(path, data)

    ways = {"executor": executor, "aiofiles": _aiofiles_durably, "on the loop": on_the_loop}
    print(f"{files} files each, in {directory}; median latency per file, worst lag of a 1 ms ticker")
    print("| file | " + " | ".join(ways) + " |")
    print("| --- |" + " --- |" * len(ways))
    for label, size in SIZES.items():
        data = os.urandom(size)
        cells = []
        for way in ways.values():
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                await _measure(way, Path(scratch), data, 3)  # warm-up: threads started, files created
                median, lag = await _measure(way, Path(scratch), data, files)
            cells.append(f"{median * 1e3:.2f} ms, lag {lag * 1e3:.1f} ms")
        print(f"| {label} | " + " | ".join(cells) + " |")
    pool.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="file system to write to")
    parser.add_argument("--files", type=int, default=200, help="files per size and way")
    options = parser.parse_args()
    asyncio.run(main(options.dir, options.files))
