"""Which thread runs which stage of a chunk's trip: the stage chain cut into lanes.

A lane is a stage with workers and the stages after it that have none (``workers: 0``): its threads
take a unit from the lane's queue and run it through every stage of the lane in turn, with no
hand-over between them. After its lane, a unit goes to the first later lane that has work to do on it
(a tensor chunk needs nothing from serialize, and nothing from compress with ``codec: none``), so a
stage with nothing to do never wakes a thread. Each hand-over between threads wakes one, which must
take the GIL from the trainer (stage_threads.py): on a Python-bound trainer on a host with few cores,
``workers: 0`` for every stage after capture gives one thread per chunk from copy to write, as a plain
thread doing the same would (issue 16, goal 4). It also means no overlap of one chunk's copy with
another's write: durable takes longer, and capture, which an attached optimizer's next step waits
for, runs only as fast as the writes. README "Threads" says when to choose it.

Nothing overtakes a close: the last worker of a lane closes the next lane's queue once its own queue is
closed and empty, so whatever it put further on was put before that lane closes the one after.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .metrics import StageStats
from .stage_threads import Handoff
from .units import Chunk

Work = Callable[[object], object]  # a stage's work on a unit: what it hands on (None: the unit itself)


@dataclass
class Step:
    """One stage as a unit meets it: its work, whether it has nothing to do on a unit, its stats."""

    stats: StageStats
    work: Work
    passes: Callable[[object], bool]


@dataclass
class Lane:
    """Stages run one after another by the same ``workers`` threads, fed by ``inbox``."""

    steps: list[Step]
    workers: int
    inbox: Handoff

    def passes(self, unit: object) -> bool:
        return all(step.passes(unit) for step in self.steps)


def _nbytes(unit: object) -> int:
    return len(unit.payload) if isinstance(unit, Chunk) else 0


def run_lane(lanes: list[Lane], index: int, lock: threading.Lock, left: list[int]) -> None:
    """One worker of ``lanes[index]``, until its queue is closed and empty; ``left``: its lane's workers
    still running (shared by them, under ``lock``, which also guards the stats)."""
    lane, later = lanes[index], lanes[index + 1 :]
    while (unit := lane.inbox.get()) is not None:
        for step in lane.steps:
            if step.passes(unit):
                with lock:
                    step.stats.passed(_nbytes(unit))
                continue
            started = time.monotonic()
            result = step.work(unit)
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
