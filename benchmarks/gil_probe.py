"""Does a call hold the GIL? A thread, then a forked process, repeats it on 16 MiB for one second while
the main thread times ``x.add_(1)`` (a torch op that drops and retakes the GIL, like a trainer's).

Equal trainer loss from the thread and from the process means the call costs the trainer CPU share,
not the GIL; a call that held the GIL would cost the thread far more than the process.

    python benchmarks/gil_probe.py        # ~20 s, printed only (RESULTS.md quotes it)
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash
from harness.copy_floor import host_buffers
from harness.paths import bench_root
from harness.units import MiB


def trainer_gaps(call: Callable[[], object], in_process: bool, seconds: float = 1.0) -> np.ndarray:
    """The main thread's op-to-op gaps while ``call`` repeats in a thread or a forked process."""
    stop = threading.Event()
    fork = multiprocessing.get_context("fork")
    process_stop = fork.Event()

    def repeat() -> None:
        while not (stop.is_set() or process_stop.is_set()):
            call()

    worker: threading.Thread | multiprocessing.process.BaseProcess
    worker = fork.Process(target=repeat) if in_process else threading.Thread(target=repeat)
    worker.start()
    x = torch.ones(8)
    gaps = []
    last = time.perf_counter()
    end = last + seconds
    while last < end:
        x.add_(1)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    stop.set()
    process_stop.set()
    worker.join()
    return np.array(gaps)


def main() -> int:
    torch.set_num_threads(1)
    src, dst = host_buffers([torch.empty(16 * MiB, dtype=torch.uint8)] * 2)
    src[:] = 1
    with bench_root("gil_probe") as root:
        fd = os.open(root / "probe.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        calls: dict[str, Callable[[], object]] = {
            "xxh3_64_hexdigest 16 MiB": lambda: xxhash.xxh3_64_hexdigest(memoryview(src)),
            "np.copyto 16 MiB": lambda: np.copyto(dst, src),
            "pwrite O_DIRECT 16 MiB": lambda: os.pwrite(fd, memoryview(src), 0),
            "sleep 2 ms (idle)": lambda: time.sleep(0.002),
        }
        print(f"xxhash {xxhash.VERSION}, load average {os.getloadavg()[0]:.2f}")
        try:
            for name, call in calls.items():
                for in_process in (False, True):
                    gaps = trainer_gaps(call, in_process)
                    print(f"{name:26s} {'process' if in_process else 'thread':8s} trainer ops/s {len(gaps):7d}  "
                          f"gaps > 1 ms: {gaps[gaps > 1e-3].sum() * 1e3:5.0f} ms  max gap {gaps.max() * 1e3:5.1f} ms")
        finally:
            os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
