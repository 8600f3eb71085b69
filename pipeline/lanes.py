"""Which thread runs which stage of a chunk's trip: the stage chain cut into lanes.

A lane is a stage with workers and the stages after it that have none (``workers: 0``): its threads
take a unit from the lane's queue and run it through every stage of the lane in turn, with no
hand-over between them. After its lane, a unit goes to the first later lane that has work to do on it
(a tensor chunk needs nothing from serialize, and nothing from compress with ``codec: none``), so a
stage with nothing to do never wakes a thread. Each hand-over between threads wakes one, which must
take the GIL from the trainer (stage_threads.py): on a Python-bound trainer on a host with few cores,
``workers: 0`` for every stage after capture gives one thread per chunk from copy to write, as a plain
thread doing the same would. It also means no overlap of one chunk's copy with
another's write: durable takes longer, and capture, which an attached optimizer's next step waits
for, runs only as fast as the writes. README "Threads" says when to choose it.

Nothing overtakes a close: the last worker of a lane closes the next lane's queue once its own queue is
closed and empty, so whatever it put further on was put before that lane closes the one after.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .config_stages import StageConfig
from .metrics import StageStats
from .stage_threads import Flow, Handoff, run_workers
from .trace import marked
from .units import Chunk, Stage, Unit


@dataclass
class Step:
    """One stage as a unit meets it, and its stats."""

    stats: StageStats
    stage: Stage


@dataclass
class Lane:
    """Stages run one after another by the same ``workers`` threads, fed by ``inbox``."""

    steps: list[Step]
    workers: int
    inbox: Handoff

    def passes(self, unit: Unit) -> bool:
        return all(step.stage.passes(unit) for step in self.steps)


def lanes_of(chain: Sequence[tuple[StageConfig, Step]], flow: Flow, slab_count: int) -> list[Lane]:
    """The chain cut into lanes: a stage with workers starts one, each stage without joins the one before."""
    lanes: list[Lane] = []
    for config, step in chain:
        if config.workers:  # capture always has some (config.py): the first lane starts with it
            # Past capture every chunk holds a host-cache slab, so the cache already bounds what is queued
            # there; a smaller bound would only hold capture back behind persist (measured: 1.5 GB captured
            # in 0.7 s instead of 0.2 s with a cache holding all of it), and capture is what the trainer
            # waits for.
            bound = config.queue if not lanes else max(config.queue, slab_count)
            step.stats.queue_bound = bound
            lanes.append(Lane([step], config.workers, Handoff(bound, flow)))
        else:
            lanes[-1].steps.append(step)
    return lanes


async def run_flow(
    flow: Flow,
    lanes: Sequence[tuple[Lane, concurrent.futures.Executor]],
    units: list[Unit],
    feeder: concurrent.futures.Executor,
    lock: threading.Lock,
) -> None:
    """Every unit through the lanes, each lane's workers on its pool; the first error of any is raised."""
    chain = [lane for lane, _ in lanes]
    calls: list[tuple[concurrent.futures.Executor, Callable[..., None], tuple]] = [
        (feeder, feed, (units, chain[0].inbox))
    ]
    for i, (lane, pool) in enumerate(lanes):
        left = [lane.workers]  # the last of them to finish closes the next lane's queue
        calls += [(pool, run_lane, (chain, i, lock, left))] * lane.workers
    try:
        await run_workers(flow, calls)
    finally:
        for lane in chain:
            lane.steps[0].stats.queued(lane.inbox.peak)


def feed(units: list[Unit], queue: Handoff) -> None:
    """The first lane's units, then its close: waits while its queue is full."""
    for unit in units:
        queue.put(unit)
    queue.close()


def _nbytes(unit: Unit) -> int:
    return len(unit.payload) if isinstance(unit, Chunk) else 0


def run_lane(lanes: list[Lane], index: int, lock: threading.Lock, left: list[int]) -> None:
    """One worker of ``lanes[index]``, until its queue is closed and empty; ``left``: its lane's workers
    still running (shared by them, under ``lock``, which also guards the stats)."""
    lane, later = lanes[index], lanes[index + 1 :]
    while (unit := lane.inbox.get()) is not None:
        for step in lane.steps:
            if step.stage.passes(unit):
                with lock:
                    step.stats.passed(_nbytes(unit))
                continue
            started = time.monotonic()
            with marked(step.stats.name):
                result = step.stage.run(unit)
            unit = unit if result is None else result
            with lock:
                step.stats.unit_done(started, time.monotonic(), _nbytes(unit))
        for next_lane in later:
            if not next_lane.passes(unit):
                next_lane.inbox.put(unit)
                break
            with lock:
                for step in next_lane.steps:
                    step.stats.passed(_nbytes(unit))
    with lock:
        left[0] -= 1
        last = left[0] == 0
    if last and later:
        later[0].inbox.close()
