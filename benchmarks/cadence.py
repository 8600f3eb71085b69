"""Benchmark: ``cadence: {every: auto}`` on the example GPT: the interval it settles on, and what it costs.

The same training steps, interleaved ``--repeats`` times: plain, and with ``runner.maybe_checkpoint(step)``
after every step (a memory tier in /dev/shm as the persist tier, captured into its slots, keep_last 1;
NVMe flushed every ``--flush-every`` steps by the node agent), each checkpointing run on tiers of its
own. Reported per round: the steps checkpointed and the gaps between them, and the slowdown
(the run's wall time over the plain run's, minus one), which the cadence keeps near its budget (3%),
and the same against each run's own median step (see :func:`own_excess`): on a VM whose plain runs
drift by tens of percent between rounds, the first is mostly that drift.

    python benchmarks/cadence.py --preset medium --steps 80 --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.gpt_state import GPTState, build_gpt
from harness.units import MiB

from tierstate import Runner


def layout(root: Path, shm: Path, nbytes: int, flush_every: int, budget: float) -> dict[str, Any]:
    return {
        "chunk_size": 64 * MiB, "host_cache": {"size": 256 * MiB},
        "tiers": {"memory": {"kind": "memory", "path": str(shm), "size": 3 * nbytes + 256 * MiB,
                             "retention": {"keep_last": 1}},
                  "nvme": {"path": str(root / "nvme"), "flush": {"every": flush_every}, "retention": {"keep_last": 2}}},
        "agent": {"enabled": True}, "cadence": {"every": "auto", "budget": budget},
    }  # fmt: skip


def train(state: GPTState, steps: int, runner: Runner | None) -> tuple[float, list[int], list[float]]:
    """Seconds for ``steps`` training steps (with ``runner``: ``maybe_checkpoint`` after each), the steps it
    checkpointed, and each step's seconds (the call included)."""
    taken, each = [], []
    started = last = time.perf_counter()
    for step in range(1, steps + 1):
        state.train_step()
        if runner is not None and runner.maybe_checkpoint(step) is not None:
            taken.append(step)
        now = time.perf_counter()
        each.append(now - last)
        last = now
    return last - started, taken, each


def own_excess(each: list[float]) -> float:
    """The run's time beyond as many of its own median steps, as a share of that: what its checkpoints cost,
    measured against the steps of the same run (most of them untouched), so the VM's drift between runs
    (their neighbours) stays out; a slowdown spread evenly over every step would stay out too."""
    median = statistics.median(each)
    return sum(each) / (median * len(each)) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flush-every", type=int, default=40)
    parser.add_argument("--budget", type=float, default=0.03)
    args = parser.parse_args()
    state = build_gpt(args.preset)
    slowdowns, excesses = [], []
    for round_ in range(args.repeats):
        plain, _, plain_each = train(state, args.steps, None)
        root = Path(tempfile.mkdtemp(prefix="tierstate-cadence-"))
        shm = Path(tempfile.mkdtemp(prefix="tierstate-cadence-", dir="/dev/shm"))
        try:
            runner = Runner.from_dict(layout(root, shm, state.tensor_bytes, args.flush_every, args.budget))
            runner.register(**state.providers())
            seconds, taken, each = train(state, args.steps, runner)
            runner.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
        slowdowns.append(seconds / plain - 1)
        excesses.append(own_excess(each) - own_excess(plain_each))
        gaps = [b - a for a, b in zip(taken, taken[1:], strict=False)]
        print(f"round {round_ + 1}: plain {plain:.2f} s, every: auto {seconds:.2f} s = {slowdowns[-1]:+.1%}; "
              f"against its own median step {excesses[-1]:+.1%} (the plain run's own excess taken off); "
              f"{len(taken)} checkpoints at steps {taken}; gaps {gaps}")  # fmt: skip
    print(f"median slowdown {statistics.median(slowdowns):+.1%}, against each run's own median step "
          f"{statistics.median(excesses):+.1%}, for a budget of {args.budget:.0%} "
          f"({args.preset} GPT, {state.tensor_bytes / 1e6:.0f} MB of state, {args.steps} steps)")


if __name__ == "__main__":
    main()
