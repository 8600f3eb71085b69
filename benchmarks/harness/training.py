"""The training loop with a checkpoint every few steps, per method and interleaved over rounds."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from .checkpointer import Checkpointer
from .disk import settle
from .gpt_state import GPTState
from .report import progress
from .stats import interleave


def train_run(
    state: GPTState, ckpt: Checkpointer, steps: int, every: int, sync: Callable[[], object] | None = None
) -> dict[str, Any]:
    """Train ``steps`` steps, checkpointing after every ``every``-th (none in the last interval, so the
    last checkpoint's background work still overlaps training); ``sync`` ends each step on a GPU."""
    ckpt.clear()
    settle()
    first = len(ckpt.records)
    step_s = []
    if sync:
        sync()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        t = time.perf_counter()
        state.train_step(before_step=ckpt.before_step)
        if step % every == 0 and step + every <= steps:
            ckpt.save(step)
        if sync:
            sync()
        step_s.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - started
    drain_s = ckpt.drain()
    records = ckpt.records[first:]
    return {"loop_s": loop_s, "drain_s": drain_s, "step_s": step_s,
            "blocked_s": [r.blocked_s for r in records], "durable_s": [r.durable_s for r in records]}


def train_rounds(
    state: GPTState,
    ckpts: Mapping[str, Checkpointer],
    steps: int,
    every: int,
    repeats: int,
    sync: Callable[[], object] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """:func:`train_run` of every method, interleaved over ``repeats`` rounds; one progress line per run."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ckpts}
    for repeat, name in interleave(list(ckpts), repeats):
        result = train_run(state, ckpts[name], steps, every, sync)
        runs[name].append(result)
        progress(f"round {repeat + 1} {name:30s} loop {result['loop_s']:.2f} s  blocked "
                 + " ".join(f"{b:.3f}" for b in result["blocked_s"]) + " s")
    return runs
