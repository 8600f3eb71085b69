"""Benchmark: time lost per failure. Train the example GPT, SIGKILL it at a random moment, restart it,
and measure the wasted time: from the kill until training is back at the step where it was killed.

As the checkpointing papers report it (Gemini, CheckFreq, PCcheck): for each method, in the same run,

1. **Interval.** The method's cost per checkpoint is measured in the trainer itself (cycles of steps
   with a checkpoint against the same cycles without, interleaved, medians), and its interval is
   the fewest steps between checkpoints that keep that cost within 3% of the step time
   (``ceil(cost / (0.03 * step))``), and never shorter than the checkpoint takes to be durable
   everywhere (for tierstate: in the memory tier and flushed to NVMe), so no request waits for the
   one before it.
2. **Kills.** A trainer process checkpoints every ``interval`` steps; once its first checkpoint is
   durable it is SIGKILLed after a delay drawn uniformly from one interval (a random phase of its
   checkpoint cycle). A new process is started at once: it imports, builds the model and AdamW,
   restores the newest checkpoint it can read, and trains (checkpointing as before) until it has
   completed the step the killed one had completed. Wasted time = that moment minus the kill, in
   parts: process start + imports, model build, restore, and the re-done work since the restored step.

Methods: tierstate (persist to a memory tier in /dev/shm, flushed to NVMe; restart builds the model on
the meta device, ``tierstate.materialize``, and restores from memory), ``copy-floor`` (the physical limit
of checkpointing into memory: one memcpy of every tensor into reused shared memory, a commit record, no
checksum and no disk; its restart builds as tierstate's and copies the bytes straight back: see
harness/copy_floor.py SharedCopyFloor), ``torch.save`` (+ ``torch.load``,
synchronous, fsync + rename) and DCP ``async_save`` (+ ``dcp.load``; a background stager), both
restarting as their documentation shows (the model built as usual; DCP's AdamW state initialised
before ``dcp.load``, which loads in place).

    python benchmarks/recovery.py                        # medium GPT (0.3 GB of state), 5 kills per method
    python benchmarks/recovery.py --preset small --kills 3
    python benchmarks/recovery.py --nvme-every 200      # NVMe at its own, slower cadence: memory sets the interval
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.cli import parser
from harness.machine import start_run
from harness.paths import REPO_ROOT, bench_root
from harness.report import Report, progress, publish
from harness.stats import median
from harness.units import MiB, fmt_bytes, fmt_ratio, fmt_s

FLOOR = "copy-floor"
COMPETITORS = ["torch.save", "dcp.async_save"]
METHODS = ["tierstate", FLOOR, *COMPETITORS]
SLOWDOWN = 0.03  # the steady-state cost each method's interval is chosen to stay within
SHM = Path("/dev/shm")
CHUNK = 64 * MiB


# --- the trainer (parent and child processes alike) ----------------------------------------------


def tierstate_config(root: Path, memory: Path, nbytes: int, flush_every: int | None, agent: bool) -> dict[str, Any]:
    """Persist to a memory tier holding two checkpoints (keep_last 1, as the README sizes it), flushed to NVMe
    every ``flush_every`` steps (None: no NVMe tier, for measuring the memory tier's part of the cost), by the
    node agent (``agent``: a process of its own, niced) or by the runner in the trainer's process."""
    cache = (int(nbytes * 1.06) // CHUNK + 8) * CHUNK
    tiers: dict[str, Any] = {
        "memory": {"kind": "memory", "path": str(memory), "size": 2 * (nbytes + 64 * MiB),
                   "retention": {"keep_last": 1}},
    }  # fmt: skip
    if flush_every is not None:
        tiers["nvme"] = {"path": str(root / "nvme"), "scope": "node", "flush": {"every": flush_every},
                         "retention": {"keep_last": 1}}  # fmt: skip
    return {"chunk_size": CHUNK, "host_cache": {"size": cache}, "tiers": tiers, "agent": {"enabled": agent}}


def _emit(event: str, **fields: Any) -> None:
    """One event line on stdout (one write: lines from two threads never interleave), with the wall time."""
    os.write(1, (json.dumps({"event": event, "t": time.time(), **fields}) + "\n").encode())


@dataclass
class Trainer:
    """The GPT state and one method's way of checkpointing and restoring it."""

    method: str
    state: Any
    root: Path
    memory: Path
    flush_every: int | None = 1  # tierstate: NVMe receives the checkpoints of steps that are multiples of it
    agent: bool = True  # tierstate: flushed by the node agent (else by the runner, in the trainer's process)
    runner: Any = None
    ckpt: Any = None
    floor: Any = None
    on_durable: Any = None  # called with each step once durable (everywhere it goes)
    pending: list[Any] = field(default_factory=list)

    def open(self) -> None:
        if self.method == "tierstate":
            from tierstate import Runner

            config = tierstate_config(self.root, self.memory, self.state.tensor_bytes, self.flush_every, self.agent)
            self.runner = Runner.from_dict(config)
            self.runner.register(**self.state.providers())
        elif self.method == FLOOR:
            from harness.copy_floor import SharedCopyFloor
            from harness.tensors import iter_tensors

            self.floor = SharedCopyFloor(list(iter_tensors(self.state.state_dict())), self.memory)
        elif self.method == "torch.save":
            from harness.competitors import TorchSaveCheckpointer

            self.ckpt = TorchSaveCheckpointer(self.state, self.root / "torch")
            self.ckpt.root.mkdir(parents=True, exist_ok=True)
        else:
            from harness.competitors import DCPAsyncCheckpointer

            self.ckpt = DCPAsyncCheckpointer(self.state, self.root / "dcp", staging="async")
            self.ckpt.root.mkdir(parents=True, exist_ok=True)

    def before_step(self) -> None:
        if self.floor is not None:
            for future in self.pending:
                future.result()  # the copy ends before the optimizer changes what it copies
            self.pending.clear()
        if self.ckpt is not None:
            self.ckpt.before_step()  # tierstate's runner waits in its own optimizer pre-hook

    def save(self, step: int) -> Any:
        """Request a checkpoint; returns what to wait on for it to be durable everywhere it goes."""
        if self.method == "tierstate":
            handle = self.runner.checkpoint(step)
            futures = list(handle.tier_futures.values())
            if self.on_durable is not None:
                _when_all(futures, lambda: self.on_durable(step))
            return futures
        if self.floor is not None:
            future = self.floor.save(step)
            self.pending.append(future)
            if self.on_durable is not None:
                future.add_done_callback(lambda _f: self.on_durable(step))
            return [future]
        self.ckpt.save(step)
        if self.method == "torch.save":
            if self.on_durable is not None:
                self.on_durable(step)
            return []
        future = self.ckpt.durable
        if self.on_durable is not None:
            future.add_done_callback(lambda _f: self.on_durable(step))
        return [future]

    def restore_latest(self) -> int:
        """Restore the newest checkpoint this method can read; its step."""
        if self.method == "tierstate":
            return self.runner.restore("latest").step
        if self.floor is not None:
            return self.floor.restore()
        if self.method == "torch.save":
            done = [int(p.stem.split("-")[1]) for p in self.ckpt.root.glob("step-*.pt")]
        else:  # DCP writes .metadata last: a directory without it is an interrupted save
            done = [int(p.parent.name.split("-")[1]) for p in self.ckpt.root.glob("step-*/.metadata")]
        step = max(done)
        self.ckpt.restore(step)
        return step

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.floor is not None:
            self.floor.close()
        if self.ckpt is not None:
            self.ckpt.close()


def _when_all(futures: list[Any], then: Any) -> None:
    """Call ``then()`` once every future is done (whatever their outcome)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one(_future: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for future in futures:
        future.add_done_callback(one)


def build(preset: str, method: str, for_restore: bool) -> Any:
    """The GPT and AdamW. A restart of tierstate or the copy floor builds on the meta device (the restore sets
    every value); DCP's restart initialises AdamW's state and the floor's allocates it, since they load into
    the tensors they are given."""
    from harness.gpt_state import build_gpt, build_gpt_for_restore

    if not for_restore:
        return build_gpt(preset)
    if method not in ("tierstate", FLOOR):
        state = build_gpt(preset, warm_steps=0)
        if method == "dcp.async_save":
            _init_adamw_state(state.optimizer)
        return state
    state = build_gpt_for_restore(preset)
    if method == FLOOR:
        _allocate_adamw_state(state.optimizer)
    return state


def _allocate_adamw_state(optimizer: Any) -> None:
    """The floor's restart: every moment tensor AdamW's first step would create, allocated and not computed
    (``empty_like``), the tensors its copy goes straight back into. One zero-gradient step, as DCP's restart
    takes, would charge the floor an optimizer step it has no need of."""
    import torch

    for group in optimizer.param_groups:
        for p in group["params"]:
            moments = ["exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if group["amsgrad"] else [])]
            optimizer.state[p] = {"step": torch.tensor(0.0), **{name: torch.empty_like(p) for name in moments}}


def _init_adamw_state(optimizer: Any) -> None:
    """What torch.distributed.checkpoint.state_dict does before a load: one step with zero gradients and
    lr 0, so that every moment tensor exists to be loaded into."""
    import torch

    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def child(spec: dict[str, Any]) -> None:
    """A trainer process: ``start`` (train from ``first``, checkpointing every ``every`` steps, until
    killed) or ``restart`` (restore the newest checkpoint, train until step ``until`` is done)."""
    if spec["method"] in ("tierstate", FLOOR):
        from tierstate import Runner, empty_init, materialize  # noqa: F401  # the package's names load on first use: now
    elif spec["method"] == "dcp.async_save":
        import torch.distributed.checkpoint  # noqa: F401  # now, not inside the first save or the restore
    _emit("imported")
    restart = spec["mode"] == "restart"
    state = build(spec["preset"], spec["method"], for_restore=restart)
    _emit("built")
    trainer = Trainer(spec["method"], state, Path(spec["root"]), Path(spec["memory"]), spec.get("flush_every"),
                      spec["agent"])
    trainer.open()
    trainer.on_durable = lambda step: _emit("durable", step=step)
    _emit("opened")
    step = spec["first"]
    if restart:
        step = trainer.restore_latest()
        _emit("restored", step=step)
    every, until = spec["every"], spec.get("until")
    while until is None or step < until:
        state.train_step(before_step=trainer.before_step)
        step += 1
        _emit("step", step=step)
        if step % every == 0:
            trainer.save(step)
    _emit("back", step=step)
    os._exit(0)  # the measurement is done: no drain of checkpoints still in flight


# --- the parent: intervals, kills, restarts ----------------------------------------------------


@dataclass
class Window:
    """A run of training steps: its seconds, each checkpoint's seconds to durable, and its cycles."""

    seconds: float
    durable: list[float]
    cycles: list[float]  # seconds from the end of each cycle's first step (its checkpoint asked there) to the next's


def _window(
    state: Any, trainer: Trainer | None, steps: int, step0: int, every: int = 1, count: int = 1
) -> Window:
    """``steps`` training steps in ``count`` cycles of ``every`` steps (and one more step), with ``trainer`` a
    checkpoint asked at the start of each cycle (after its first step); the window lasts at least until the
    last is durable, so all of their background work falls inside it. Without ``trainer``, the same cycles
    of plain steps."""
    started = time.perf_counter()
    waits: list[Any] = []
    durable: list[float] = []
    marks: list[float] = []
    for i in range(steps):
        state.train_step(before_step=trainer.before_step if trainer is not None else None)
        marks.append(time.perf_counter())
        if trainer is not None and i % every == 0 and i // every < count:
            slot = len(durable)
            durable.append(float("nan"))
            futures = trainer.save(step0 + i)
            _when_all(futures, lambda at=marks[-1], slot=slot: durable.__setitem__(slot, time.perf_counter() - at))
            if not futures:  # synchronous: durable when save returned
                durable[slot] = time.perf_counter() - marks[-1]
            waits += futures
    for future in waits:
        future.result()
    cycles = [marks[(j + 1) * every] - marks[j * every] for j in range(count) if (j + 1) * every < len(marks)]
    return Window(time.perf_counter() - started, durable, cycles)


MEMORY_ONLY = "tierstate (memory tier only)"
MIN_CHECKPOINTS, MIN_STEPS = 4, 8  # per window: a memory checkpoint costs a fifth of a step, lost in one's noise


def calibrate(
    preset: str, root: Path, memory: Path, repeats: int, agent: bool, nvme_every: int | None
) -> dict[str, dict[str, float]]:
    """Per method: step time, cost per checkpoint, time to durable, and the interval that follows.

    Each round runs, per method, a window of plain steps and the same window with a few checkpoints (at
    least ``MIN_CHECKPOINTS``, over at least ``MIN_STEPS`` steps), each asked once the one before it should
    be durable (its first measured time to durable, in steps), so none waits for another. A round's cost is
    its median cycle (a checkpoint and the steps until the next is asked) less its median plain cycle of the
    same length: medians, since on a shared VM a step now and then takes twice its time, which a sum over a
    window turns into a checkpoint's whole cost; and paired within the round, since the step time drifts by
    a quarter between rounds. The method's cost is the median of its rounds'.

    tierstate is measured twice, with and without its flush to NVMe, so that the flush's share of the cost
    can be spread over several checkpoints (``flush.every``): see :func:`tierstate_interval`. Its NVMe copies
    come at least as often as the most frequent competitor's, or every ``nvme_every`` steps."""
    state = build(preset, "torch.save", for_restore=False)
    trainers = {m: Trainer(m, state, root / f"calibrate-{m}", memory / f"calibrate-{m}", agent=agent) for m in METHODS}
    trainers[MEMORY_ONLY] = Trainer("tierstate", state, root / "calibrate-mem", memory / "calibrate-mem", None, agent)
    for trainer in trainers.values():
        trainer.open()
    step = 10
    probe: dict[str, float] = {}
    for method, trainer in trainers.items():  # warm-up: first plans, files, allocations; a first estimate
        step += 2
        probe[method] = _window(state, trainer, 2, step).durable[0]
    step_s = _window(state, None, 2, 0).seconds / 2
    spacing = {m: max(1, math.ceil(probe[m] / step_s)) for m in trainers}
    count = {m: max(MIN_CHECKPOINTS, math.ceil(MIN_STEPS / spacing[m])) for m in trainers}
    windows = {m: count[m] * spacing[m] + 1 for m in trainers}
    costs: dict[str, list[float]] = {m: [] for m in trainers}
    durables: dict[str, list[float]] = {m: [] for m in trainers}
    steps: list[float] = []
    for repeat in range(repeats):
        for method, trainer in trainers.items():
            plain = _window(state, None, windows[method], 0, spacing[method], count[method])
            with_some = _window(state, trainer, windows[method], step, spacing[method], count[method])
            step += windows[method]
            costs[method].append(median(with_some.cycles) - median(plain.cycles))
            durables[method] += with_some.durable
            steps += [c / spacing[method] for c in plain.cycles]
            progress(f"calibrate round {repeat + 1} {method:28s} {count[method]} cycles of {spacing[method]} steps: "
                     f"median {median(plain.cycles):.3f} s plain, {median(with_some.cycles):.3f} s with a checkpoint "
                     f"(durable in {median(with_some.durable):.2f} s)")  # fmt: skip
    for trainer in trainers.values():
        trainer.close()
    step_s = median(steps)
    facts: dict[str, dict[str, float]] = {}
    for method in trainers:
        cost, durable = max(0.0, median(costs[method])), median(durables[method])
        by_cost = math.ceil(cost / (SLOWDOWN * step_s)) if cost > 0 else 1
        by_durable = math.ceil(durable / step_s)
        facts[method] = {"step_s": step_s, "cost_s": cost, "durable_s": durable, "every": max(1, by_cost, by_durable),
                         "by_cost": by_cost, "by_durable": by_durable, "costs": costs[method]}  # fmt: skip
    disk_every = nvme_every or min(facts[m]["every"] for m in COMPETITORS)
    facts["tierstate"].update(tierstate_interval(facts, disk_every))
    return facts


def tierstate_interval(facts: dict[str, dict[str, Any]], disk_every: int) -> dict[str, float]:
    """tierstate's interval ``every`` and NVMe flush multiple: the fewest steps ``k`` whose cost stays within
    the budget when NVMe receives every ``m``-th checkpoint, ``m`` as large as keeps NVMe copies at least
    every ``disk_every`` steps (``k * m <= disk_every``), and no request waiting for the previous
    checkpoint (in memory) or flush (on NVMe)."""
    memory, full = facts[MEMORY_ONLY], facts["tierstate"]
    step_s = full["step_s"]
    flush_cost = max(0.0, full["cost_s"] - memory["cost_s"])
    k = 1
    while True:
        m = max(1, disk_every // k)
        fits = memory["cost_s"] + flush_cost / m <= SLOWDOWN * k * step_s
        if fits and k * step_s >= memory["durable_s"] and k * m * step_s >= full["durable_s"]:
            return {"every": k, "flush_every": k * m, "flush_cost_s": flush_cost,
                    "cost_s": memory["cost_s"] + flush_cost / m}  # fmt: skip
        k += 1


class Process:
    """A trainer child and the events it reports, read on a thread of their own."""

    def __init__(self, spec: dict[str, Any]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "benchmarks"), str(REPO_ROOT),
                                                             os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        self.spawned = time.time()
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        self.events: list[dict[str, Any]] = []
        self.durable = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            self.events.append(event)
            if event["event"] == "durable":
                self.durable.set()

    def finish(self) -> int:
        code = self.proc.wait()
        self._reader.join()
        if code not in (0, -signal.SIGKILL):
            assert self.proc.stderr is not None
            raise RuntimeError(f"trainer exited with {code}:\n{self.proc.stderr.read().decode()[-4000:]}")
        return code

    def at(self, name: str) -> dict[str, Any]:
        return next(e for e in self.events if e["event"] == name)


def one_failure(preset: str, method: str, facts: dict[str, float], root: Path, memory: Path, agent: bool,
                rng: random.Random) -> dict[str, float]:  # fmt: skip
    """Start a trainer, SIGKILL it at a random moment of its checkpoint cycle, restart it; the parts."""
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(memory, ignore_errors=True)
    every = int(facts["every"])
    spec = {"preset": preset, "method": method, "root": str(root), "memory": str(memory), "every": every,
            "first": max(0, every - 2), "mode": "start", "flush_every": facts.get("flush_every", 1),
            "agent": agent}  # fmt: skip
    first = Process(spec)
    if not first.durable.wait(timeout=600):
        first.proc.kill()
        first.finish()
        raise RuntimeError(f"{method}: no checkpoint durable within 600 s")
    delay = rng.uniform(0.0, every * facts["step_s"])
    threading.Event().wait(delay)  # the random moment (not a synchronisation: nothing is waited for)
    killed_at = time.time()
    first.proc.kill()
    first.finish()
    done = [e["step"] for e in first.events if e["event"] == "step" and e["t"] <= killed_at]
    killed_step = max(done)
    durable = max(e["step"] for e in first.events if e["event"] == "durable" and e["t"] <= killed_at)
    second = Process({**spec, "mode": "restart", "until": killed_step})
    second.finish()
    imported, built, opened = (second.at(name)["t"] for name in ("imported", "built", "opened"))
    restored, back = second.at("restored"), second.at("back")["t"]
    return {
        "wasted_s": back - killed_at,
        "start_imports_s": imported - killed_at,
        "build_s": built - imported,
        "open_s": opened - built,
        "restore_s": restored["t"] - opened,
        "redo_s": back - restored["t"],
        "redo_steps": killed_step - restored["step"],
        "killed_step": killed_step,
        "restored_step": restored["step"],
        "durable_before_kill": durable,
        "delay_s": delay,
    }


PARTS = ["start_imports_s", "build_s", "open_s", "restore_s", "redo_s"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(json.loads(argv[1]))
        return 0
    p = parser("recovery", __doc__, preset="medium", repeats=3)
    p.add_argument("--kills", type=int, default=5, help="failures per method")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--no-agent", dest="agent", action="store_false",
                   help="tierstate's runner flushes to NVMe in the trainer's process (default: the node agent does)")
    p.add_argument("--nvme-every", type=int, default=None, metavar="N",
                   help="tierstate copies to NVMe at least every N steps, its own slower cadence (default: at least "
                        "as often as the most frequent competitor writes its disk checkpoint)")
    args = p.parse_args(argv)
    facts = start_run()
    rng = random.Random(args.seed)
    memory = SHM / f"tierstate-bench-recovery-{uuid.uuid4().hex[:8]}"
    failures: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    try:
        with bench_root("recovery") as root:
            intervals = calibrate(args.preset, root, memory, args.repeats, args.agent, args.nvme_every)
            for method in METHODS:
                f = intervals[method]
                progress(f"{method}: step {f['step_s']:.3f} s, cost {f['cost_s'] * 1e3:.1f} ms per checkpoint, "
                         f"durable in {f['durable_s']:.2f} s -> every {f['every']} steps")  # fmt: skip
            for kill in range(args.kills):
                for method in METHODS:
                    got = one_failure(args.preset, method, intervals[method], root / method, memory / method,
                                      args.agent, rng)
                    failures[method].append(got)
                    progress(f"kill {kill + 1} {method:15s} wasted {got['wasted_s']:.2f} s: " + ", ".join(
                        f"{k} {got[k]:.2f}" for k in PARTS) + f" (re-did {got['redo_steps']} steps)")  # fmt: skip
            nbytes = _state_bytes(args.preset)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    publish("recovery", [_report(args, intervals, failures, nbytes)], facts, argv, args.results_dir)
    return 0


def _state_bytes(preset: str) -> int:
    from harness.gpt_state import build_gpt

    return build_gpt(preset).tensor_bytes


def _report(args: Any, intervals: dict[str, dict[str, float]], failures: dict[str, list[dict[str, float]]],
            nbytes: int) -> Report:  # fmt: skip
    report = Report(
        "recovery",
        f"Wasted time per failure (SIGKILL, restart), {args.preset} GPT ({fmt_bytes(nbytes)} of state), "
        f"median of {args.kills} kills per method",
        ["method", "interval (steps)", "cost / checkpoint", "wasted", "start + imports", "model build",
         "runner / checkpointer", "restore", "re-done work", "re-done steps", "tierstate ÷ this"],
    )  # fmt: skip
    ours = median(f["wasted_s"] for f in failures["tierstate"])
    for method in METHODS:
        runs, f = failures[method], intervals[method]
        wasted = median(r["wasted_s"] for r in runs)
        report.add(method, str(int(f["every"])), fmt_s(f["cost_s"]), fmt_s(wasted),
                   *(fmt_s(median(r[k] for r in runs)) for k in PARTS), f"{median(r['redo_steps'] for r in runs):g}",
                   fmt_ratio(ours / wasted))  # fmt: skip
    step_s, ts, mem = intervals["tierstate"]["step_s"], intervals["tierstate"], intervals[MEMORY_ONLY]
    wasted = {m: median(r["wasted_s"] for r in failures[m]) for m in METHODS}
    best = min(COMPETITORS, key=lambda m: wasted[m])
    report.note(f"tierstate's wasted time is {fmt_ratio(wasted['tierstate'] / wasted[best])} of the best competitor's "
                f"({best}); target <= 0.4x")  # fmt: skip
    floor = intervals[FLOOR]
    cost = fmt_ratio(mem["cost_s"] / floor["cost_s"]) if floor["cost_s"] else "n/a (the floor's cost was lost in noise)"
    report.note(f"against the copy floor: wasted {fmt_ratio(wasted['tierstate'] / wasted[FLOOR])} (target <= 1.25x); "
                f"cost of a memory checkpoint {cost} (target <= 1.5x); interval "
                f"{fmt_ratio(ts['every'] / floor['every'])} (target <= 1.5x); "
                "the floor restarts as tierstate does (meta build + materialize)")  # fmt: skip
    build = {m: median(r["build_s"] for r in failures[m]) for m in METHODS}
    same_build = wasted[best] - build[best] + build["tierstate"]
    report.note(f"with {best}'s model build as cheap as tierstate's meta build (load_state_dict(assign=True) on a "
                f"meta model), its wasted time would be {fmt_s(same_build)}: tierstate "
                f"{fmt_ratio(wasted['tierstate'] / same_build)} of it")  # fmt: skip
    report.note(f"step time {fmt_s(step_s)}; each interval is the fewest steps whose checkpoint cost (trainer time "
                f"lost: the median cycle of a checkpoint and the steps to the next less the median plain cycle) "
                f"stays within {SLOWDOWN:.0%} of them, and no fewer than a checkpoint takes to be durable "
                "everywhere")  # fmt: skip
    disk_cadence = "disk copies at least as often as the competitors'"
    if args.nvme_every:
        disk_cadence = (f"at least every {args.nvme_every} steps, its own cadence (--nvme-every; a node loss, unlike "
                        "a SIGKILL, goes back to NVMe)")  # fmt: skip
    report.note(f"tierstate: persist to a memory tier (/dev/shm, keep_last 1), costing {fmt_s(mem['cost_s'])} a "
                f"checkpoint; NVMe receives every {int(ts['flush_every'] // ts['every'])}th (steps multiple of "
                f"{int(ts['flush_every'])}: {disk_cadence}, by "
                f"{'the node agent' if args.agent else 'the runner in the trainer'}), each flush costing "
                f"{fmt_s(ts['flush_cost_s'])}; the restart builds on the meta device + tierstate.materialize and "
                "restores from memory (its runner resumes any flush the kill interrupted)")  # fmt: skip
    report.note("torch.save: sync, fsync + rename, torch.load; DCP async_save: background staging thread, dcp.load; "
                "both restart by building the model as usual (random init)")
    report.raw = {"intervals": intervals, "failures": failures, "state_bytes": nbytes, "args": vars(args)}
    return report


if __name__ == "__main__":
    sys.exit(main())
