"""Goal 4 of issue 16: how much a background checkpoint slows a Python-bound trainer (GIL and CPU share).

On a GPU the trainer's host thread mostly launches kernels: what matters is how long the checkpoint's
threads keep it from running Python. Here a tiny MLP trains on the CPU with one torch thread (a step
of ~200 us, mostly interpreter and dispatch), while a checkpoint of a separate ``--size`` state
(``TensorDictProvider`` declared ``changes="never"``, so capture is lazy, in the background) runs.
Each run trains ``--warm-steps`` steps alone, then requests the checkpoint and keeps training until
it is durable, then trains ``--warm-steps`` / 2 steps alone again. Inflation = mean step time while
the checkpoint runs / mean step time alone, minus one (a mean, not a median: GIL stalls are a few
long steps), where "alone" is the second half of the steps before and the steps after, so that a
drift of the machine's speed during the run cancels out; since the methods' windows differ (a
buffered write's fsync waits seconds), also the trainer seconds lost per checkpoint = the window's
step times minus as many steps at the mean time alone. Methods, interleaved over ``--repeats`` rounds:

* ``tierstate``: the runner (capture into its host cache, xxh3, O_DIRECT persist, commit),
* ``tierstate-1worker``: the same with one capture and one persist worker: at most two busy pipeline
  threads, so on a 2-core machine one core stays free for the trainer,
* ``tierstate-16MiB``: the default pipeline with 16 MiB chunks (the default until issue 16) instead of
  64: four times the hand-overs between stage threads (what each costs the trainer is the difference),
* ``tierstate-1thread``: one capture worker and ``workers: 0`` for every later stage (pipeline/lanes.py):
  the thread that copies a chunk also checksums and writes it, as the floor's one thread does,
* ``floor-thread``: the copy floor, one plain Python thread: memcpy of the state into reused buffers,
  buffered write to one file, fsync (all of it in calls that release the GIL),
* ``floor-direct-thread``: the same, written with O_DIRECT as tierstate writes (no page-cache copy),
* ``floor-hash-thread``: the O_DIRECT floor with tierstate's checksum (xxh3 of every buffer) between
  the copy and the write: the least a checkpointer that verifies what it wrote must do,
* ``floor-overlap-2threads``: floor-hash-thread's work shaped as tierstate's default pipeline: one plain
  thread copies and checksums each tensor and hands it to a second one that writes it (O_DIRECT) while
  the next is copied: what the overlap itself costs the trainer, without tierstate,
* ``floor-process``: the same work as ``floor-thread`` in a forked child process: it competes for CPU but not the GIL,
* ``tierstate-si0.5ms``: tierstate with ``sys.setswitchinterval(0.0005)`` (default 5 ms) around the
  run: if the trainer waits on the GIL for pipeline threads that hold it in Python, this changes it.

``--profile`` instead runs one tierstate checkpoint with cProfile in every pipeline thread and prints
the functions that ran longest in Python (holding the GIL) and in calls.

    python benchmarks/python_bound.py                         # 512 MiB, 7 rounds, ~2 min
    python benchmarks/python_bound.py --size 64MiB --repeats 1 --results-dir /tmp/bench-smoke   # smoke
    python benchmarks/python_bound.py --profile
"""

from __future__ import annotations

import cProfile
import multiprocessing
import pstats
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness.cli import parser
from harness.copy_floor import copy_hash_then_write_overlapped, copy_write_fsync, host_buffers
from harness.dict_state import synthetic_state
from harness.disk import settle
from harness.machine import start_run
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.thread_cpu import cpu_by_thread, cpu_delta_by_name
from harness.tierstate_checkpointer import ONE_THREAD, TierstateCheckpointer, cache_for
from harness.units import MiB, fmt_bytes, parse_size

FLOOR_THREADS = ("floor-thread", "floor-direct-thread", "floor-hash-thread", "floor-overlap-2threads")
METHODS = [
    "tierstate", "tierstate-1worker", "tierstate-1thread", "tierstate-16MiB", *FLOOR_THREADS, "floor-process",
    "tierstate-si0.5ms",
]


class TinyMLP:
    """A trainer whose step is almost all Python and dispatch: three small linear layers, SGD."""

    def __init__(self, width: int, batch: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(batch, width, generator=generator)
        self.y = torch.randint(0, 10, (batch,), generator=generator)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.optimizer.step()


def _floor_child(sources: list[torch.Tensor], path: Path, conn: Any) -> None:
    """The forked copy floor: buffers of its own, then one copy + write + fsync per message."""
    buffers = host_buffers(sources)
    conn.send("ready")
    while conn.recv():
        copy_write_fsync(sources, buffers, path)
        conn.send("done")


class Background:
    """The methods, each as start() -> a poll that says whether the checkpoint is done."""

    def __init__(self, state: Any, root: Path) -> None:
        self.sources = list(state.tensors.values())
        # The floor's child is forked first: every page the parent writes after a fork is copied on its
        # first write (copy-on-write, while the child lives), which made the first two checkpoints into
        # memory allocated before the fork 5-15x slower and cost the trainer 60-90% of its steps then.
        self._conn, child = multiprocessing.get_context("fork").Pipe()
        self._child = multiprocessing.get_context("fork").Process(
            target=_floor_child, args=(self.sources, root / "floor-process.bin", child), daemon=True
        )
        self._child.start()
        self._conn.recv()
        self.buffers = host_buffers(self.sources)
        self.floor_file = root / "floor-thread.bin"
        self.tierstate = TierstateCheckpointer(state, root / "tierstate", cache_bytes=cache_for(state.tensor_bytes))
        one_worker = {"pipeline.stages.capture.workers": 1, "pipeline.stages.persist.workers": 1}
        self.one_worker = TierstateCheckpointer(
            state, root / "tierstate-1worker", cache_bytes=cache_for(state.tensor_bytes), overrides=one_worker
        )
        self.one_thread = TierstateCheckpointer(
            state, root / "tierstate-1thread", cache_bytes=cache_for(state.tensor_bytes), overrides=ONE_THREAD
        )
        self.small_chunks = TierstateCheckpointer(
            state, root / "tierstate-16MiB", cache_bytes=cache_for(state.tensor_bytes, 16 * MiB), chunk_bytes=16 * MiB
        )
        for ckpt in self.checkpointers.values():
            ckpt.save(0)  # warm-up: the plan, first-use imports
            ckpt.drain()
        self.step = 0
        self.floor_cpu_s = 0.0

    @property
    def checkpointers(self) -> dict[str, TierstateCheckpointer]:
        return {"tierstate": self.tierstate, "tierstate-1worker": self.one_worker, "tierstate-1thread": self.one_thread,
                "tierstate-16MiB": self.small_chunks}

    def start(self, method: str) -> Callable[[], bool]:
        self.step += 1
        if method.startswith("tierstate"):
            ckpt = self.checkpointers.get(method, self.tierstate)  # tierstate-si0.5ms: the default one
            handle = ckpt.runner.checkpoint(self.step)
            return handle.done
        if method in FLOOR_THREADS:
            thread = threading.Thread(target=self._floor_thread, args=(method,), name=method)
            thread.start()
            return lambda: not thread.is_alive()
        if method == "floor-process":
            self._conn.send(True)
            return self._conn.poll
        raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)}")

    def _floor_thread(self, method: str) -> None:
        """The copy floor on this thread, its CPU seconds kept (the thread is gone when the run reads them)."""
        started = time.thread_time()
        if method == "floor-overlap-2threads":  # its writer thread has ended before the CPU is read: not counted
            copy_hash_then_write_overlapped(self.sources, self.buffers, self.floor_file)
        else:
            copy_write_fsync(self.sources, self.buffers, self.floor_file, method != "floor-thread",
                             hashed=method == "floor-hash-thread")
        self.floor_cpu_s = time.thread_time() - started

    def finish(self, method: str) -> None:
        if method == "floor-process":
            self._conn.recv()
        for ckpt in self.checkpointers.values():
            ckpt.clear()
        self.floor_file.unlink(missing_ok=True)

    def close(self) -> None:
        self._conn.send(False)
        self._child.join()
        for ckpt in self.checkpointers.values():
            ckpt.close()


def _steps(trainer: TinyMLP, count: int) -> list[float]:
    """Seconds of each of ``count`` steps."""
    times = []
    for _ in range(count):
        t = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t)
    return times


def timed_run(trainer: TinyMLP, background: Background, method: str, warm_steps: int) -> dict[str, Any]:
    """Steps alone, then steps while ``method`` checkpoints, until it is durable, then steps alone
    again; per-step seconds of the window and of the steps alone that bracket it."""
    settle()
    interval = sys.getswitchinterval()
    if method.endswith("-si0.5ms"):
        sys.setswitchinterval(0.0005)
    try:
        alone = _steps(trainer, warm_steps)
        before = cpu_by_thread()
        started = time.perf_counter()
        done = background.start(method)
        during = []
        while not done():
            t = time.perf_counter()
            trainer.step()
            during.append(time.perf_counter() - t)
        window = time.perf_counter() - started
        cpu = cpu_delta_by_name(before, cpu_by_thread())
        alone = alone[warm_steps // 2 :] + _steps(trainer, warm_steps // 2)
    finally:
        sys.setswitchinterval(interval)
    if method in FLOOR_THREADS:
        cpu[method] = background.floor_cpu_s
    background.finish(method)
    base = sum(alone) / len(alone)
    mean = sum(during) / max(1, len(during))
    stalls = [s for s in during if s > 5 * median(alone)]
    return {"alone_s": alone, "during_s": during, "window_s": window, "inflation": mean / base - 1,
            "lost_s": sum(during) - len(during) * base,
            "median_inflation": median(during) / median(alone) - 1, "stalls": len(stalls),
            "stall_s": sum(stalls), "cpu": cpu}


def profile_pipeline(background: Background) -> None:
    """One tierstate checkpoint with a cProfile in each pipeline thread; the top functions printed."""
    profiles: list[tuple[str, cProfile.Profile]] = []

    def start_profile(*_: object) -> None:
        profile = cProfile.Profile()
        profiles.append((threading.current_thread().name, profile))
        profile.enable()  # replaces this hook for the rest of the thread

    threading.setprofile(start_profile)
    background.tierstate.close()  # a fresh runner, its threads started under the hook
    state_root = background.tierstate.root
    background.tierstate = TierstateCheckpointer(
        background.tierstate.state, state_root, cache_bytes=cache_for(background.tierstate.state.tensor_bytes))
    background.tierstate.save(1)  # its pools start their threads now, under the hook
    background.tierstate.drain()
    threading.setprofile(None)  # type: ignore[arg-type]
    for profile_ in (p for _, p in profiles):
        profile_.clear()  # only the timed checkpoint below
    background.tierstate.clear()
    background.tierstate.save(2)
    background.tierstate.drain()
    stats = None
    for _, profile in profiles:
        stats = pstats.Stats(profile) if stats is None else stats.add(profile)
    if stats is not None:
        print(f"cProfile of {len(profiles)} pipeline threads ({', '.join(sorted({n for n, _ in profiles}))}), "
              "one checkpoint; tottime of Python functions = GIL held")
        stats.sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    cli = parser("python_bound", __doc__, repeats=7, methods=METHODS, tag=True)
    cli.add_argument("--size", default="512MiB", help="checkpointed state size")
    cli.add_argument("--tensor-mb", type=int, default=16, help="MiB per tensor of the checkpointed state")
    cli.add_argument("--width", type=int, default=128, help="MLP width (step time)")
    cli.add_argument("--batch", type=int, default=16)
    cli.add_argument("--warm-steps", type=int, default=1000,
                     help="steps alone before each checkpoint (and half as many after)")
    cli.add_argument("--profile", action="store_true", help="cProfile the pipeline threads of one checkpoint instead")
    args = cli.parse_args(argv)
    facts = start_run()
    torch.set_num_threads(1)
    trainer = TinyMLP(args.width, args.batch)
    for _ in range(200):
        trainer.step()
    state = synthetic_state(parse_size(args.size), args.tensor_mb * MiB, changes="never")
    methods = args.methods.split(",")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    with bench_root("python_bound") as root:
        background = Background(state, root)
        try:
            if args.profile:
                profile_pipeline(background)
                return 0
            for repeat, method in interleave(methods, args.repeats):
                run = timed_run(trainer, background, method, args.warm_steps)
                runs[method].append(run)
                progress(f"round {repeat + 1} {method:18s} step alone {median(run['alone_s']) * 1e6:.0f} us  "
                         f"inflation {run['inflation']:+.0%} (median step {run['median_inflation']:+.0%})  "
                         f"window {run['window_s']:.2f} s  lost {run['lost_s']:.3f} s  "
                         f"stalls {run['stalls']} ({run['stall_s'] * 1e3:.0f} ms)")
        finally:
            background.close()
    # The floor that does what tierstate does per byte, where it ran; the ratio is taken within each round.
    floor = next((f for f in ("floor-hash-thread", "floor-direct-thread", "floor-thread") if f in runs), methods[0])
    report = Report(
        "python_bound",
        f"Step-time inflation of a Python-bound trainer (MLP width {args.width}, batch {args.batch}, one torch "
        f"thread) while {fmt_bytes(state.tensor_bytes)} is checkpointed, {args.repeats} interleaved rounds",
        ["method", "step alone", "inflation (mean step)", "inflation (median step)", f"÷ {floor} (same round)",
         "window", "trainer s lost", f"lost ÷ {floor}'s", "stalls > 5x", "stall ms", "core-s of other threads"],
    )
    floor_lost = median(r["lost_s"] for r in runs[floor])
    for method, method_runs in runs.items():
        ratios = [r["inflation"] / f["inflation"] for r, f in zip(method_runs, runs[floor], strict=True)
                  if f["inflation"] > 0]
        other_cpu = [sum(v for k, v in r["cpu"].items() if k != "trainer (main)") for r in method_runs]
        report.add(method, f"{median(median(r['alone_s']) for r in method_runs) * 1e6:.0f} us",
                   f"{median(r['inflation'] for r in method_runs):+.1%}",
                   f"{median(r['median_inflation'] for r in method_runs):+.1%}",
                   f"{median(ratios):.2f}x", f"{median(r['window_s'] for r in method_runs):.2f} s",
                   f"{median(r['lost_s'] for r in method_runs):.3f} s",
                   f"{median(r['lost_s'] for r in method_runs) / floor_lost:.2f}x" if floor_lost > 0 else "-",
                   f"{median(r['stalls'] for r in method_runs):.0f}",
                   f"{median(r['stall_s'] for r in method_runs) * 1e3:.0f}",
                   f"{median(other_cpu):.3f}")
    report.note("floor-process's child is another process: its CPU is not in 'core-s of other threads'")
    report.note(f"lost ÷ {floor}'s: the medians' ratio (a round's own can be negative: noise on the floor's)")
    report.raw.update({"runs": runs, "args": vars(args), "state_bytes": state.tensor_bytes})
    publish("python_bound", [report], facts, argv, args.results_dir, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
