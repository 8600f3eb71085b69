"""Benchmark 3: restore time and GB/s vs torch.load and DCP load, next to the disk's read bandwidth and memcpy.

The same GPT state is saved once by each method; then, interleaved for ``--repeats`` rounds, each
checkpoint is restored into the LIVE model and optimizer (what resuming a run needs): tierstate
``runner.restore(step)`` (reads every frame, verifies its xxh3 checksum, loads in place), from its
NVMe tier (``tierstate``) and from a memory tier (``tierstate(memory)``: ``kind: memory`` in
/dev/shm, what a restart on the same node reads); ``memcpy``, the floor of any restore into live
tensors: a host copy of every tensor taken once (untimed), copied with ``dst.copy_(src)`` into the
live parameters and AdamW moments;
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
    python benchmarks/restore.py --methods memcpy,tierstate(memory),tierstate   # without the competitors
    python benchmarks/restore.py --memory-dir /mnt/huge-tmpfs    # a memory tier on another tmpfs

``tierstate(memory) into a fresh model`` restores from a memory tier a closed runner wrote into the GPT and
AdamW as a restart builds them (``empty_init`` + ``materialize``, untimed), against ``memcpy into fresh
tensors``: the same bytes copied into new ``torch.empty`` tensors, whose pages the copy faults in as well.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness.checkpointer import Checkpointer
from harness.cli import parser
from harness.competitors import TorchSaveCheckpointer
from harness.disk import disk_read_seconds, disk_write_seconds, drop_caches
from harness.gpt_state import GPTState, build_gpt, build_gpt_for_restore
from harness.machine import start_run
from harness.methods import closing_all, make_checkpointers
from harness.paths import DEFAULT_YAML, bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tensors import iter_tensors
from harness.tierstate_checkpointer import TierstateCheckpointer, cache_for, memory_checkpointer, memory_tier_config
from harness.timing import time_save
from harness.units import MiB, fmt_bytes, fmt_ratio, fmt_s, gbps

from tierstate import Runner

DISK = ["disk cold read", "disk O_DIRECT read"]
MEMCPY = "memcpy"
MEMORY = "tierstate(memory)"
MEMCPY_FRESH = "memcpy into fresh tensors"
MEMORY_FRESH = "tierstate(memory) into a fresh model"
FRESH = {MEMCPY_FRESH: MEMCPY, MEMORY_FRESH: MEMORY}  # each fresh method and what it needs saved
ALL = [MEMCPY, MEMORY, MEMCPY_FRESH, MEMORY_FRESH, "tierstate", "torch.load", "torch.load(mmap)", "dcp.load"]
SAVED_BY = {"tierstate": "tierstate", "torch.load": "torch.save", "torch.load(mmap)": "torch.save",
            "dcp.load": "dcp.save"}
SHM = Path("/dev/shm")


def live_tensors(state: GPTState) -> list[torch.Tensor]:
    """The live parameters, buffers and AdamW moments (views of them: what a restore writes into)."""
    return list(iter_tensors(state.state_dict()))


def timed_memcpy(state: GPTState, sources: list[torch.Tensor]) -> float:
    """Scramble, copy every tensor's saved bytes (already in host memory) into the live one, check; seconds."""
    expected = state.digest()
    state.scramble()
    live = live_tensors(state)
    started = time.perf_counter()
    with torch.no_grad():
        for dst, src in zip(live, sources, strict=True):
            dst.copy_(src)
    elapsed = time.perf_counter() - started
    if state.digest() != expected:
        raise RuntimeError("memcpy: restored state differs")
    return elapsed


def timed_memcpy_fresh(sources: list[torch.Tensor]) -> float:
    """Copy every tensor's saved bytes into new tensors of their shapes (``torch.empty``, as ``materialize`` gives a
    restarted model: its pages are faulted in by the copy); seconds."""
    fresh = [torch.empty_like(src) for src in sources]
    started = time.perf_counter()
    with torch.no_grad():
        for dst, src in zip(fresh, sources, strict=True):
            dst.copy_(src)
    elapsed = time.perf_counter() - started
    if any(not torch.equal(dst, src) for dst, src in zip(fresh, sources, strict=True)):
        raise RuntimeError("memcpy into fresh tensors: copied state differs")
    return elapsed


def saved_for_restarts(state: GPTState, directory: Path, step: int) -> Path:
    """``state`` checkpointed at ``step`` into a memory tier at ``directory`` by a runner closed since, as a
    crashed trainer leaves it for its restart."""
    saver = memory_checkpointer(state, directory, cache_bytes=cache_for(state.tensor_bytes))
    try:
        time_save(saver, step)
    finally:
        saver.close()
    return directory


def timed_fresh_restore(preset: str, directory: Path, step: int, expected: float) -> float:
    """Build the GPT and AdamW as a restart does (meta device, ``materialize``: untimed), restore ``step`` from the
    memory tier at ``directory`` (one pass into the fresh parameters), check the fingerprint; seconds."""
    state = build_gpt_for_restore(preset)
    reader = Runner.from_yaml(DEFAULT_YAML, {"tiers": {"nvme": memory_tier_config(directory, 0, slots=False)},
                                             "host_cache.size": 128 * MiB})  # fmt: skip
    try:
        reader.register(**state.providers())
        started = time.perf_counter()
        reader.restore(step)
        elapsed = time.perf_counter() - started
    finally:
        reader.close()
    if state.digest() != expected:
        raise RuntimeError(f"{MEMORY_FRESH}: restored state differs")
    return elapsed


def memory_tier(state: GPTState, directory: Path, cache_bytes: int) -> TierstateCheckpointer:
    """tierstate persisting to a memory tier (``kind: memory``) at ``directory`` (a tmpfs), holding one step."""
    ckpt = memory_checkpointer(state, directory, cache_bytes=cache_bytes)
    ckpt.name = MEMORY
    return ckpt


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
    cli = parser("restore", __doc__, preset="full", repeats=3, methods=ALL)
    cli.add_argument("--memory-dir", type=Path, default=SHM, help="the tmpfs of the memory tier (default /dev/shm)")
    args = cli.parse_args(argv)
    methods = [m for m in ALL if m in args.methods.split(",")]
    methods = [m for m in ALL if m in methods or m in {FRESH[f] for f in methods if f in FRESH}]
    facts = start_run()
    state = build_gpt(args.preset)
    nbytes = state.tensor_bytes
    can_drop = drop_caches()
    cold: dict[str, list[float]] = {name: [] for name in DISK + methods}
    warm: dict[str, list[float]] = {name: [] for name in methods if name not in (MEMCPY, MEMCPY_FRESH, MEMORY_FRESH)}
    step = 1
    savers_wanted = list(dict.fromkeys(SAVED_BY[m] for m in methods if m in SAVED_BY))
    shm = Path(tempfile.mkdtemp(prefix="tierstate-bench-restore-", dir=args.memory_dir))
    with (
        bench_root("restore") as root,
        closing_all(make_checkpointers(savers_wanted, state, root, cache_bytes=cache_for(nbytes))) as savers,
        closing_all({MEMORY: memory_tier(state, shm, cache_for(nbytes))} if MEMORY in methods else {}) as memory,
    ):
        savers |= memory
        for saver in savers.values():
            time_save(saver, step)
        sources = [t.detach().clone() for t in live_tensors(state)] if MEMCPY in methods else []
        restarts = saved_for_restarts(state, shm / "restarts", step) if MEMORY_FRESH in methods else shm
        probe = root / "disk-probe.bin"
        disk_write_seconds(probe, nbytes, direct=True)
        for repeat, name in interleave(DISK + methods, args.repeats):
            if name in DISK:
                cold[name].append(disk_read_seconds(probe, direct=name == "disk O_DIRECT read"))
                line = f"{cold[name][-1]:.2f} s"
            elif name == MEMCPY:
                cold[name].append(timed_memcpy(state, sources))
                line = f"{cold[name][-1]:.3f} s"
            elif name == MEMCPY_FRESH:
                cold[name].append(timed_memcpy_fresh(sources))
                line = f"{cold[name][-1]:.3f} s"
            elif name == MEMORY_FRESH:
                cold[name].append(timed_fresh_restore(args.preset, restarts, step, state.digest()))
                line = f"{cold[name][-1]:.3f} s"
            else:
                ckpt = savers[SAVED_BY.get(name, name)]
                mmap_load = name == "torch.load(mmap)"
                cold[name].append(timed_restore(state, ckpt, step, cold=can_drop, mmap_load=mmap_load))
                warm[name].append(timed_restore(state, ckpt, step, cold=False, mmap_load=mmap_load))
                line = f"cold {cold[name][-1]:.3f} s warm {warm[name][-1]:.3f} s"
            progress(f"round {repeat + 1} {name:20s} {line}")
        stored = {name: savers[SAVED_BY.get(name, name)].stored_bytes(step) for name in methods if name in savers
                  or name in SAVED_BY}
    shutil.rmtree(shm, ignore_errors=True)

    disk_s = min(median(cold["disk cold read"]), median(cold["disk O_DIRECT read"]))
    label = "cold" if can_drop else "warm (drop_caches refused)"
    report = Report(
        "restore",
        f"Restore into the live model + AdamW: {fmt_bytes(nbytes)} of GPT state, median of {args.repeats} rounds",
        ["method", f"{label}", "GB/s", "÷ bytes/disk bw", "÷ memcpy", "torch.load÷this", "dcp.load÷this",
         "warm", "warm GB/s", "warm ÷ memcpy"],
    )
    base = {name: median(cold[name]) for name in ("torch.load", "dcp.load", MEMCPY) if name in cold}
    for name in DISK + methods:
        t = median(cold[name])
        w = median(warm[name]) if name in warm else None
        restores = name in methods and name != MEMCPY
        report.add(
            name, fmt_s(t), f"{gbps(nbytes, t):.2f}", fmt_ratio(t / disk_s),
            fmt_ratio(t / base[MEMCPY]) if MEMCPY in base else "-",
            fmt_ratio(base["torch.load"] / t) if restores and "torch.load" in base else "-",
            fmt_ratio(base["dcp.load"] / t) if restores and "dcp.load" in base else "-",
            fmt_s(w) if w is not None else "-",
            f"{gbps(nbytes, w):.2f}" if w is not None else "-",
            fmt_ratio(w / base[MEMCPY]) if w is not None and MEMCPY in base else "-",
        )
    report.note(f"disk read bandwidth = the better probe, {gbps(nbytes, disk_s):.2f} GB/s; "
                f"page cache dropped before every cold read: {'yes' if can_drop else 'NO (not permitted)'}")
    report.note("tierstate verifies an xxh3 checksum of every frame while reading; torch.load and DCP verify nothing")
    report.note("memcpy: dst.copy_(src) of every tensor from a host copy taken beforehand into the live one (the "
                "floor of any restore into live tensors); a memory tier is tmpfs: its cold and warm reads are alike")
    if MEMORY_FRESH in cold and MEMCPY_FRESH in cold:
        fresh = median(cold[MEMORY_FRESH]) / median(cold[MEMCPY_FRESH])
        report.note(f"into a fresh model (meta build + materialize, AdamW without state: what a restart restores into; "
                    f"one pass into the parameters, the moments into buffers of their own): {fmt_ratio(fresh)} a "
                    "memcpy of the same bytes into fresh tensors (whose pages the copy faults in too)")  # fmt: skip
    report.raw = {"state_bytes": nbytes, "cold": cold, "warm": warm, "stored": stored, "dropped": can_drop,
                  "args": vars(args)}
    publish("restore", [report], facts, argv, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
