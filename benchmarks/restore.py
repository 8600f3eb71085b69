"""Benchmark 3: restore time and GB/s vs torch.load and DCP load, next to the disk's read bandwidth.

The same GPT state is saved once by each method; then, interleaved for ``--repeats`` rounds, each
checkpoint is restored into the LIVE model and optimizer (what resuming a run needs): tierstate
``runner.restore(step)`` (reads every frame, verifies its xxh3 checksum, loads in place);
``torch.load`` (+ ``mmap=True``) followed by ``load_state_dict``; DCP ``load`` in place followed by
``load_state_dict``. Before every restore the live state is overwritten (untimed) and afterwards
its fingerprint is checked, so a restore that loads nothing cannot look fast.

Cold reads drop the page cache first (``echo 3 > /proc/sys/vm/drop_caches``, needs root; the
report says when that was refused and the numbers are warm). Warm = the same restore again at
once, file still cached (tierstate's own files are written O_DIRECT, so its first read is cold
either way). The disk's read bandwidth is a cold buffered and an O_DIRECT sequential read of a
file of the same size, in the same rounds.

    python benchmarks/restore.py                  # full GPT state, ~4 min
    python benchmarks/restore.py --preset small --repeats 1
"""

from __future__ import annotations

import sys
import time

from harness.checkpointer import Checkpointer
from harness.cli import parser
from harness.competitors import TorchSaveCheckpointer
from harness.disk import disk_read_seconds, disk_write_seconds, drop_caches
from harness.gpt_state import GPTState, build_gpt
from harness.machine import start_run
from harness.methods import closing_all, make_checkpointers
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tierstate_checkpointer import cache_for
from harness.timing import time_save
from harness.units import fmt_bytes, fmt_ratio, fmt_s, gbps

DISK = ["disk cold read", "disk O_DIRECT read"]
METHODS = ["tierstate", "torch.load", "torch.load(mmap)", "dcp.load"]
SAVED_BY = {"tierstate": "tierstate", "torch.load": "torch.save", "torch.load(mmap)": "torch.save",
            "dcp.load": "dcp.save"}
SAVERS = list(dict.fromkeys(SAVED_BY.values()))


def timed_restore(state: GPTState, ckpt: Checkpointer, step: int, cold: bool, mmap_load: bool) -> float:
    """Scramble the live state, (drop caches,) restore, check the fingerprint; returns the restore seconds."""
    expected = state.digest()
    state.scramble()
    if cold:
        drop_caches()
    if isinstance(ckpt, TorchSaveCheckpointer):
        ckpt.mmap_load = mmap_load
    started = time.perf_counter()
    ckpt.restore(step)
    elapsed = time.perf_counter() - started
    got = state.digest()
    if got != expected:
        raise RuntimeError(f"{ckpt.name}: restored state differs (fingerprint {got} != {expected})")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    args = parser("restore", __doc__, preset="full", repeats=3).parse_args(argv)
    facts = start_run()
    state = build_gpt(args.preset)
    nbytes = state.tensor_bytes
    can_drop = drop_caches()
    cold: dict[str, list[float]] = {name: [] for name in DISK + METHODS}
    warm: dict[str, list[float]] = {name: [] for name in METHODS}
    step = 1
    with (
        bench_root("restore") as root,
        closing_all(make_checkpointers(SAVERS, state, root, cache_bytes=cache_for(nbytes))) as savers,
    ):
        for saver in savers.values():
            time_save(saver, step)
        probe = root / "disk-probe.bin"
        disk_write_seconds(probe, nbytes, direct=True)
        for repeat, name in interleave(DISK + METHODS, args.repeats):
            if name in DISK:
                cold[name].append(disk_read_seconds(probe, direct=name == "disk O_DIRECT read"))
                line = f"{cold[name][-1]:.2f} s"
            else:
                ckpt = savers[SAVED_BY[name]]
                mmap_load = name == "torch.load(mmap)"
                cold[name].append(timed_restore(state, ckpt, step, cold=can_drop, mmap_load=mmap_load))
                warm[name].append(timed_restore(state, ckpt, step, cold=False, mmap_load=mmap_load))
                line = f"cold {cold[name][-1]:.2f} s warm {warm[name][-1]:.2f} s"
            progress(f"round {repeat + 1} {name:20s} {line}")
        stored = {name: savers[SAVED_BY[name]].stored_bytes(step) for name in METHODS}

    disk_s = min(median(cold["disk cold read"]), median(cold["disk O_DIRECT read"]))
    label = "cold" if can_drop else "warm (drop_caches refused)"
    report = Report(
        "restore",
        f"Restore into the live model + AdamW: {fmt_bytes(nbytes)} of GPT state, median of {args.repeats} rounds",
        ["method", f"{label}", "GB/s", "÷ bytes/disk bw", "torch.load÷this", "dcp.load÷this", "warm", "warm GB/s"],
    )
    base_torch = median(cold["torch.load"])
    base_dcp = median(cold["dcp.load"])
    for name in DISK + METHODS:
        t = median(cold[name])
        w = median(warm.get(name, []))
        report.add(
            name, fmt_s(t), f"{gbps(nbytes, t):.2f}", fmt_ratio(t / disk_s),
            fmt_ratio(base_torch / t) if name in METHODS else "-",
            fmt_ratio(base_dcp / t) if name in METHODS else "-",
            fmt_s(w) if name in METHODS else "-",
            f"{gbps(nbytes, w):.2f}" if name in METHODS else "-",
        )
    report.note(f"disk read bandwidth = the better probe, {gbps(nbytes, disk_s):.2f} GB/s; "
                f"page cache dropped before every cold read: {'yes' if can_drop else 'NO (not permitted)'}")
    report.note("tierstate verifies an xxh3 checksum of every frame while reading; torch.load and DCP verify nothing")
    report.raw = {"state_bytes": nbytes, "cold": cold, "warm": warm, "stored": stored, "dropped": can_drop,
                  "args": vars(args)}
    publish("restore", [report], facts, argv, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
