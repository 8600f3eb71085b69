"""Benchmark: restart time from the memory tier vs node NVMe (page cache dropped) vs the PFS, and the
trainer's blocked time with the memory tier vs without.

Setup: the example GPT + AdamW is checkpointed once through the cluster layout (configs/cluster.yaml):
persist to a memory tier in /dev/shm (kind: memory), flushed to an NVMe directory (scope: node) and
a PFS directory (shared). On this machine "NVMe" and "PFS" are two directories on the same virtual
disk; the PFS row is what a restart pays when no node-local copy is left.

Restart: for each source, in interleaved rounds, a NEW process is started that imports torch and
tierstate, builds the model and a fresh AdamW, builds a runner on that one tier and restores. Two
times are reported: the whole restart (the parent's clock from spawning the process to the child
reporting its state restored and its fingerprint checked) and ``restore()`` alone. Before every
NVMe and PFS restart the page cache is dropped (``/proc/sys/vm/drop_caches``; where that is refused,
``posix_fadvise(DONTNEED)`` on each file of the checkpoint, said in the notes). The memory tier's
pages are its storage: they stay, which is the point of it.

Blocked time: the same training loop checkpoints every other step, once persisting to the memory
tier (with its flushes to NVMe and the PFS running behind) and once persisting to NVMe (today's
layout, flushing to the PFS); the median of ``handle.blocked_s``, in interleaved rounds. Each
checkpoint is made durable before the next is asked (untimed), so ``in_flight: wait`` adds nothing.

    python benchmarks/restart.py                          # full GPT state (1.5 GB)
    python benchmarks/restart.py --preset small --repeats 1
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from harness.cli import parser
from harness.disk import drop_caches
from harness.gpt_state import build_gpt
from harness.machine import start_run
from harness.paths import REPO_ROOT, bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tierstate_checkpointer import cache_for
from harness.units import MiB, fmt_bytes, fmt_ratio, fmt_s, gbps

SOURCES = ["memory", "nvme", "pfs"]
LAYOUTS = ["memory tier", "NVMe (no memory tier)"]
SHM = Path("/dev/shm")
CHECKPOINTS_PER_ROUND = 3
RESTART_CACHE = 64 * MiB


def cluster_tiers(root: Path, memory: Path, nbytes: int) -> dict[str, Any]:
    """configs/cluster.yaml's layout with this run's directories; the memory tier holds two checkpoints."""
    size = 2 * nbytes + 64 * MiB * 2
    return {
        "memory": {"kind": "memory", "path": str(memory), "size": size, "retention": {"keep_last": 1}},
        "nvme": {"path": str(root / "nvme"), "scope": "node", "flush": {"every": 1}, "retention": {"keep_last": 1}},
        "pfs": {"path": str(root / "pfs"), "flush": {"every": 1}},
    }  # fmt: skip


def settings(tiers: dict[str, Any], cache: int) -> dict[str, Any]:
    """The packaged default's stages, persisting to the first of ``tiers``."""
    return {"chunk_size": 16 * MiB, "host_cache": {"size": cache}, "tiers": tiers}


def one_tier(tiers: dict[str, Any], name: str) -> dict[str, Any]:
    """Only tier ``name``, without flush: what a restart from it alone reads."""
    return {name: {k: v for k, v in tiers[name].items() if k != "flush"}}


# --- the restarted process ----------------------------------------------------------------------


def child(preset: str, config: str, expected: float) -> None:
    """A restart: build the model, restore from the one tier of ``config``, check the fingerprint."""
    from tierstate import Runner

    imported_at = time.time()
    state = build_gpt(preset, warm_steps=0)
    runner = Runner.from_dict(json.loads(config))
    runner.register(**state.providers())
    started = time.perf_counter()
    result = runner.restore("latest")
    restore_s = time.perf_counter() - started
    restored_at = time.time()
    runner.close()
    if state.digest() != expected:
        raise SystemExit(f"restored state differs (fingerprint {state.digest()} != {expected})")
    print(json.dumps({"imported_at": imported_at, "restored_at": restored_at, "restore_s": restore_s,
                      "tier": result.tier}))  # fmt: skip


def forget_pages(directory: Path) -> None:
    """Drop the page cache for the files of a checkpoint (when drop_caches is refused)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def restart(preset: str, tiers: dict[str, Any], source: str, expected: float) -> dict[str, Any]:
    """One restart from ``source`` in a new process; its host cache is small (a restore reads into
    buffers of its own, not through the cache), so it does not bill allocating one to every source."""
    config = json.dumps(settings(one_tier(tiers, source), RESTART_CACHE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "benchmarks"), str(REPO_ROOT),
                                                         os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", preset, config, repr(expected)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"restart from {source} failed:\n{done.stdout}\n{done.stderr}")
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    if facts["tier"] != source:
        raise RuntimeError(f"restart from {source} was served by {facts['tier']}")
    return {"total_s": facts["restored_at"] - spawned, "imports_s": facts["imported_at"] - spawned,
            "restore_s": facts["restore_s"]}  # fmt: skip


# --- blocked time -------------------------------------------------------------------------------


def blocked_times(preset: str, tiers: dict[str, Any], cache: int) -> list[float]:
    """``handle.blocked_s`` of checkpoints every other step of a training loop on ``tiers``."""
    from tierstate import Runner

    state = build_gpt(preset)
    runner = Runner.from_dict(settings(tiers, cache))
    runner.register(**state.providers())
    runner.checkpoint(1).result()  # warm-up: first touch of the files and the tier
    blocked = []
    for step in range(2, 2 + 2 * CHECKPOINTS_PER_ROUND, 2):
        state.train_step()
        handle = runner.checkpoint(step)
        state.train_step()  # the step pre-hook waits here if the capture is still pending
        handle.result()
        blocked.append(handle.blocked_s)
    runner.close()
    return blocked


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], float(argv[3]))
        return 0
    args = parser("restart", __doc__, preset="full", repeats=3).parse_args(argv)
    facts = start_run()
    state = build_gpt(args.preset)
    nbytes = state.tensor_bytes
    cache = cache_for(nbytes)
    can_drop = drop_caches()
    memory = SHM / f"tierstate-bench-restart-{uuid.uuid4().hex[:8]}"
    times: dict[str, dict[str, list[float]]] = {s: {"total_s": [], "imports_s": [], "restore_s": []} for s in SOURCES}
    blocked: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    try:
        with bench_root("restart") as root:
            from tierstate import Runner

            tiers = cluster_tiers(root, memory, nbytes)
            runner = Runner.from_dict(settings(tiers, cache))
            runner.register(**state.providers())
            handle = runner.checkpoint(1)
            for future in handle.tier_futures.values():
                future.result()
            durable_memory_s, captured_s = handle.stats.durable_s, handle.stats.capture_s
            runner.close()
            expected = state.digest()
            del state, runner
            for repeat, source in interleave(SOURCES, args.repeats):
                if source != "memory":
                    if not can_drop:
                        forget_pages(root / source)
                    else:
                        drop_caches()
                got = restart(args.preset, tiers, source, expected)
                for key, value in got.items():
                    times[source][key].append(value)
                progress(f"round {repeat + 1} restart from {source:6s} {got['total_s']:.2f} s "
                         f"(restore {got['restore_s']:.2f} s)")  # fmt: skip

            shutil.rmtree(memory, ignore_errors=True)  # the restart's checkpoint: its RAM is the next phase's
            layouts = {
                "memory tier": cluster_tiers(root / "blocked-memory", memory / "blocked", nbytes),
                "NVMe (no memory tier)": {"nvme": {"path": str(root / "blocked-nvme" / "nvme"),
                                                   "retention": {"keep_last": 1}},
                                          "pfs": {"path": str(root / "blocked-nvme" / "pfs"), "flush": {"every": 1},
                                                  "retention": {"keep_last": 1}}},
            }  # fmt: skip
            for repeat, layout in interleave(LAYOUTS, args.repeats):
                shutil.rmtree(root / "blocked-memory", ignore_errors=True)
                shutil.rmtree(root / "blocked-nvme", ignore_errors=True)
                shutil.rmtree(memory / "blocked", ignore_errors=True)
                blocked[layout] += blocked_times(args.preset, layouts[layout], cache)
                progress(f"round {repeat + 1} blocked, {layout}: {[f'{b * 1e3:.1f} ms' for b in blocked[layout][-3:]]}")
    finally:
        shutil.rmtree(memory, ignore_errors=True)

    cold = "page cache dropped" if can_drop else "posix_fadvise DONTNEED (drop_caches refused)"
    restarts = Report(
        "restart",
        f"Restart (new process to state restored): {fmt_bytes(nbytes)} of GPT state, median of {args.repeats} rounds",
        ["source", "restart", "of it: python + imports", "restore()", "restore GB/s", "NVMe÷this (restart)",
         "NVMe÷this (restore)"],
    )  # fmt: skip
    nvme_total, nvme_restore = median(times["nvme"]["total_s"]), median(times["nvme"]["restore_s"])
    for source in SOURCES:
        total, restore = median(times[source]["total_s"]), median(times[source]["restore_s"])
        label = {"memory": "memory (/dev/shm)", "nvme": f"NVMe, {cold}", "pfs": f"PFS, {cold}"}[source]
        imports = median(times[source]["imports_s"])
        restarts.add(label, fmt_s(total), fmt_s(imports), fmt_s(restore), f"{gbps(nbytes, restore):.2f}",
                     fmt_ratio(nvme_total / total), fmt_ratio(nvme_restore / restore))  # fmt: skip
    restarts.note("restart = spawning the process, importing torch and tierstate, building the model and a fresh "
                  "AdamW, the runner, restore('latest') with every checksum verified; restore() = the last part")
    restarts.note(f"the checkpoint was captured into the host cache after {fmt_s(captured_s)} and durable in the "
                  f"memory tier after {fmt_s(durable_memory_s)} ({gbps(nbytes, durable_memory_s):.2f} GB/s), written "
                  "there straight from the cache's slabs (one copy per byte)")  # fmt: skip
    restarts.note("NVMe and PFS are two directories on the same virtual disk here")
    layouts_report = Report(
        "restart-blocked",
        f"Trainer blocked per checkpoint: {fmt_bytes(nbytes)}, median of {len(blocked[LAYOUTS[0]])} checkpoints",
        ["persist tier", "blocked (median)", "blocked (max)", "÷ without memory tier"],
    )
    base = median(blocked[LAYOUTS[1]])
    for layout in LAYOUTS:
        values = blocked[layout]
        layouts_report.add(layout, fmt_s(median(values)), fmt_s(max(values)), f"{median(values) / base:.2f}x")
    restarts.raw = {"state_bytes": nbytes, "times": times, "blocked": blocked, "dropped": can_drop,
                    "durable_memory_s": durable_memory_s, "captured_s": captured_s, "args": vars(args)}  # fmt: skip
    publish("restart", [restarts, layouts_report], facts, argv, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
