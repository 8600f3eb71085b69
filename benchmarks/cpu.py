"""Goal 3 of issue 16: the core-seconds tierstate's pipeline spends per checkpointed GB, against a bare memcpy.

A synthetic state (``--size`` in tensors of ``--tensor-mb``) is checkpointed by tierstate (lazy
capture into a host cache holding it all, xxh3, O_DIRECT persist, commit) while the main thread only
waits; every thread's on-CPU time (``/proc/self/task/<tid>/schedstat``, ns) is read before the
request and after durable and summed per thread name, so the table shows where the core-seconds go:
``tierstate-cpu`` (capture copies, hashing), ``tierstate-io`` (writes, fsync), ``tierstate-loop``
(the asyncio loop scheduling them), the trainer's own call. Against, in the same run, interleaved:

* ``memcpy``: one ``np.copyto`` per tensor of the same bytes into reused buffers (the target's unit),
* ``xxh3``: tierstate's checksum of the same bytes (every frame is hashed before it is written),
* ``memcpy+write+fsync``: the same, then a buffered write of the copy to one file and an fsync, on one
  plain thread (the "copy floor" of goal 4; its kernel page-cache copy shows what a write costs),
* ``O_DIRECT write+fsync``: only the write of those buffers, O_DIRECT as tierstate writes: the kernel's
  share of a checkpoint that no user-space change can remove.

    python benchmarks/cpu.py                       # 512 MiB in 16 MiB tensors, 5 rounds
    python benchmarks/cpu.py --size 64MiB --repeats 1 --results-dir /tmp/bench-smoke   # smoke test
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from harness.cli import parser
from harness.copy_floor import copy_write_fsync, host_buffers, memcpy_all, write_fsync
from harness.dict_state import synthetic_state
from harness.disk import settle
from harness.machine import start_run
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.stats import median
from harness.thread_cpu import cpu_by_thread, cpu_delta_by_name
from harness.tierstate_checkpointer import TierstateCheckpointer, cache_for
from harness.units import GB, MiB, fmt_bytes, fmt_ratio, fmt_s, parse_size

from tierstate.tiers.format.format import checksum  # measured on purpose: the checksum every frame gets


def measured(work: Callable[[], object]) -> tuple[float, dict[str, float]]:
    """Wall seconds of ``work`` and the on-CPU seconds every thread spent meanwhile, by thread name."""
    before = cpu_by_thread()
    started = time.perf_counter()
    work()
    wall = time.perf_counter() - started
    return wall, cpu_delta_by_name(before, cpu_by_thread())


def main(argv: list[str] | None = None) -> int:
    cli = parser("cpu", __doc__, repeats=5, tag=True)
    cli.add_argument("--size", default="512MiB", help="state size")
    cli.add_argument("--tensor-mb", type=int, default=16, help="MiB per tensor")
    cli.add_argument("--changes", default="never", choices=["never", "any"],
                     help="never: captured lazily in the background (as an attached optimizer's state); "
                     "any: copied on the trainer's thread by checkpoint()")
    args = cli.parse_args(argv)
    facts = start_run()
    state = synthetic_state(parse_size(args.size), args.tensor_mb * MiB, changes=args.changes)
    nbytes = state.tensor_bytes
    sources = list(state.tensors.values())
    buffers = host_buffers(sources)
    walls: dict[str, list[float]] = {"memcpy": [], "xxh3": [], "memcpy+write+fsync": [], "O_DIRECT write+fsync": [],
                                      "tierstate": []}
    cpus: dict[str, list[dict[str, float]]] = {name: [] for name in walls}
    with bench_root("cpu") as root:
        ckpt = TierstateCheckpointer(state, root / "tierstate", cache_bytes=cache_for(nbytes))
        try:
            ckpt.save(0)  # warm-up: first-use imports, the plan
            ckpt.drain()
            floor_file = root / "floor.bin"
            works: dict[str, Callable[[], object]] = {
                "memcpy": lambda: memcpy_all(sources, buffers),
                "xxh3": lambda: [checksum(memoryview(b)) for b in buffers],
                "memcpy+write+fsync": lambda: copy_write_fsync(sources, buffers, floor_file),
                "O_DIRECT write+fsync": lambda: write_fsync(buffers, floor_file, direct=True),
            }
            for repeat in range(args.repeats + 1):  # round 0 warms the buffers and the file up, untimed
                for name in walls:
                    ckpt.clear()
                    floor_file.unlink(missing_ok=True)
                    settle()
                    work = works.get(name) or (lambda step=repeat + 1: (ckpt.save(step), ckpt.drain()))
                    wall, cpu = measured(work)
                    if repeat:
                        walls[name].append(wall)
                        cpus[name].append(cpu)
                        progress(f"round {repeat} {name:20s} wall {wall:.3f} s  cpu "
                                 + " ".join(f"{k} {v:.3f}" for k, v in sorted(cpu.items()) if v > 0.0005))
        finally:
            ckpt.close()
    total = {name: [sum(c.values()) for c in runs] for name, runs in cpus.items()}
    memcpy_s = median(total["memcpy"])
    report = Report("cpu", f"Core-seconds per checkpoint of {fmt_bytes(nbytes)} ({len(sources)} tensors of "
                    f"{args.tensor_mb} MiB), all threads of the process, median of {args.repeats} rounds",
                    ["method", "wall", "core-s", "core-s per GB", "÷ memcpy (median)", "÷ memcpy (per round)"])
    for name in walls:
        per_round = [t / m for t, m in zip(total[name], total["memcpy"], strict=True)]
        report.add(name, fmt_s(median(walls[name])), f"{median(total[name]):.3f}",
                   f"{median(total[name]) / (nbytes / GB):.3f}", fmt_ratio(median(total[name]) / memcpy_s),
                   " ".join(f"{r:.2f}" for r in per_round))
    names = sorted({k for c in cpus["tierstate"] for k in c})
    for thread in names:
        spent = median(c.get(thread, 0.0) for c in cpus["tierstate"])
        report.note(f"tierstate thread {thread}: {spent:.3f} core-s ({spent / memcpy_s:.2f}x memcpy)")
    report.raw.update({"state_bytes": nbytes, "walls": walls, "cpu": cpus, "args": vars(args)})
    publish("cpu", [report], facts, argv, args.results_dir, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
