"""Benchmark 2: time until a checkpoint is durable, next to the disk's own sequential write bandwidth.

"Durable" means every byte fsync'd and the checkpoint committed (tierstate: manifest + atomic
rename + directory fsync; torch.save: fsync + rename + directory fsync; DCP: its FileSystemWriter
with ``sync_files=True`` and its ``.metadata`` written last). The disk is measured in the same run,
interleaved with the methods, by writing the same number of bytes to a new file in 64 MiB blocks,
once with O_DIRECT and once buffered, each followed by fsync. The better of the two is "the disk":
bytes / that bandwidth is the floor no checkpointer can beat, and the target is 1.25x of it.

``tierstate (io: buffered)`` is tierstate with O_DIRECT switched off, kept to show what the page
cache costs on this machine. ``tierstate (16 MiB chunks)`` is the chunk size that was the default
until issue 16 (64 MiB now), and ``tierstate (one thread)`` one thread per chunk from copy to write
(pipeline/lanes.py), the setting that spares a Python-bound trainer most (``python_bound.py``):
this shows what each costs in time to durable.

    python benchmarks/durable.py                  # full GPT state (~1.5 GB), ~4 min, 5 rounds
    python benchmarks/durable.py --methods tierstate --repeats 8 --tag tierstate-ab   # tierstate vs the disk only
    python benchmarks/durable.py --preset small --repeats 1   # smoke test
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from harness.cli import parser
from harness.disk import disk_write_seconds
from harness.gpt_state import build_gpt
from harness.machine import start_run
from harness.methods import closing_all, make_checkpointer, setups
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tierstate_checkpointer import ONE_THREAD, cache_for
from harness.timing import time_save, warm_up
from harness.units import MiB, fmt_bytes, fmt_ratio, fmt_s, gbps

DISK = ["disk O_DIRECT", "disk buffered+fsync"]
METHODS = ["tierstate", "tierstate (io: buffered)", "torch.save", "dcp.save", "dcp.async_save"]
# Each round: the O_DIRECT probe right before tierstate, so the ratio of the two is taken on the same
# state of a disk whose speed drifts (0.6-1.2 s for the same 1.5 GB within minutes on this VM).
ORDER = ["disk O_DIRECT", "tierstate", "tierstate (io: buffered)", "disk buffered+fsync",
         "torch.save", "dcp.save", "dcp.async_save"]


def _settings(name: str, nbytes: int) -> dict[str, Any]:
    """tierstate's settings for method ``name`` (the other methods ignore them)."""
    if name == "tierstate (16 MiB chunks)":
        return {"cache_bytes": cache_for(nbytes, 16 * MiB), "chunk_bytes": 16 * MiB}
    if name == "tierstate (one thread)":
        return {"cache_bytes": cache_for(nbytes), "overrides": ONE_THREAD}
    return {"cache_bytes": cache_for(nbytes), "io": "buffered" if "buffered" in name else "auto"}


def main(argv: list[str] | None = None) -> int:
    args = parser("durable", __doc__, preset="full", repeats=5, methods=METHODS, tag=True).parse_args(argv)
    facts = start_run()
    state = build_gpt(args.preset)
    nbytes = state.tensor_bytes
    methods = args.methods.split(",")
    seconds: dict[str, list[float]] = {name: [] for name in DISK + methods}
    stored: dict[str, int] = {}
    with (
        bench_root("durable") as root,
        closing_all({name: make_checkpointer(name, state, root, **_settings(name, nbytes))
                     for name in methods}) as ckpts,
    ):
        warm_up(ckpts.values())
        probe = root / "disk-probe.bin"
        order = [name for name in ORDER if name in DISK or name in methods]
        order += [name for name in methods if name not in order]
        for repeat, name in interleave(order, args.repeats):
            if name in DISK:
                seconds[name].append(disk_write_seconds(probe, nbytes, direct=name == "disk O_DIRECT"))
                probe.unlink()
            else:
                ckpt = ckpts[name]
                ckpt.clear()
                step = repeat + 1
                seconds[name].append(time_save(ckpt, step).durable_s)
                stored[name] = ckpt.stored_bytes(step)
            progress(f"round {repeat + 1} {name:26s} {seconds[name][-1]:.2f} s")
        setup = setups(ckpts)

    disk_s = min(median(seconds["disk O_DIRECT"]), median(seconds["disk buffered+fsync"]))
    report = Report(
        "durable",
        f"Time to durable: {fmt_bytes(nbytes)} of GPT state ({state.n_params / 1e6:.1f} M params + AdamW), "
        f"median of {args.repeats}, interleaved with the disk probes",
        ["method", "time to durable", "GB/s", "÷ bytes/disk bw", "÷ disk, same round", "torch.save÷this",
         "dcp.save÷this", "bytes on disk"],
    )
    direct = seconds["disk O_DIRECT"]
    for name in DISK + methods:
        t = median(seconds[name])
        per_round = median(a / b for a, b in zip(seconds[name], direct, strict=True))
        report.add(
            name, fmt_s(t), f"{gbps(nbytes, t):.2f}", fmt_ratio(t / disk_s), fmt_ratio(per_round),
            fmt_ratio(median(seconds["torch.save"]) / t) if "torch.save" in seconds else "-",
            fmt_ratio(median(seconds["dcp.save"]) / t) if "dcp.save" in seconds else "-",
            fmt_bytes(stored.get(name, nbytes)),
        )
    report.note(f"disk bandwidth = the better probe (median), {gbps(nbytes, disk_s):.2f} GB/s ({fmt_s(disk_s)} for "
                f"{fmt_bytes(nbytes)}); '÷ disk, same round' = median over rounds of this / the O_DIRECT probe of "
                "that round (run just before tierstate); target: tierstate within 1.25x")
    report.note_each(setup)
    report.raw = {"state_bytes": nbytes, "seconds": seconds, "stored": stored, "args": vars(args),
                  "threads": torch.get_num_threads()}
    publish("durable", [report], facts, argv, args.results_dir, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
