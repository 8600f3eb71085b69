"""When a checkpoint is due: every N steps, or as often as its measured cost stays within a share of the step.

The training time a failure loses is mostly the work done since the last checkpoint, so the interval
that matters is the shortest one training can afford. ``cadence: {every: auto, budget: 0.03}`` finds it
as CheckFreq's profiler and Orbax's continuous policy do, from the trainer's own clock: the loop calls
``runner.maybe_checkpoint(step)`` after every optimizer step, and the cadence

* times the steps that no checkpoint work overlapped (capture, persist, flushes: all settled), their
  median being the step time;
* times each checkpoint from the call that requested it until the step in which it is durable on the
  persist tier: that span less as many plain steps is what it cost the trainer (blocked time, the
  capture's copies competing for cores and memory bandwidth, the wait before the next optimizer step);
* times each checkpoint that a flush tier receives (a multiple of its ``flush.every``) likewise, until every
  copy is made: what its flushes cost the trainer (the copy's reads and writes on the trainer's cores,
  whether the runner or the node agent makes it) beyond a checkpoint into memory;
* spaces checkpoints ``k`` steps apart, the fewest whose cost stays within what the budget leaves once the
  flushes had their share (``cost / (budget * step - extra / every) <= k``), and never fewer than a
  checkpoint takes to be durable, so no request waits for the one before it.

Tiers flushed every ``flush.every`` steps keep their cadence: a step that is a multiple of a flush tier's
``every`` (above 1) is always checkpointed, so NVMe, the PFS and a bucket receive what their YAML says.
Where those flushes alone cost more than the budget, automatic checkpoints are spaced the longest
``flush.every`` apart (with one flush tier: only its steps are checkpointed), and the cadence says once,
in the log, how much less often a flush would fit.
With many ranks every rank must request the same steps (the commit is collective): the first checkpoint
is at a fixed call, each interval is agreed at a checkpoint (the largest any rank proposes, one all-gather
per checkpoint, none between), and a rank that has not yet seen its last checkpoint durable proposes twice
the interval before.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .config import PipelineConfig
from .distributed import CheckpointGroup
from .handle import CheckpointHandle

log = logging.getLogger("tierstate.cadence")

SAMPLES = 32  # step times kept: the median of the recent ones follows a changing step time
COSTS = 5  # checkpoint costs kept, for the same reason


@dataclass
class _Open:
    """A checkpoint being timed: requested by the call at ``started``, ``steps`` calls ago."""

    handle: CheckpointHandle
    started: float
    steps: int = 0


@dataclass
class Cadence:
    """The steps to checkpoint: multiples of ``every``, or with ``every="auto"`` as described above.

    ``forced``: the ``flush.every`` values above 1 (their multiples are always checkpointed). ``warmup``:
    plain steps timed before the first automatic checkpoint. ``agree``: gathers one value from every rank
    (a list with this rank's alone for one process)."""

    every: int | str
    budget: float
    warmup: int
    forced: Sequence[int]
    agree: Callable[[int], list[int]]
    interval: int = 0  # agreed steps between automatic checkpoints; 0: none taken yet
    _calls: int = 0
    _last_call: float | None = None
    _next: int | None = None
    _steps: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    _costs: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=COSTS))
    _flush_costs: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=COSTS))
    _open: _Open | None = None
    _flushing: _Open | None = None  # a flushed checkpoint timed until every copy is made
    _warned: bool = False
    _busy: list[CheckpointHandle] = field(default_factory=list)

    def maybe(self, step: int, checkpoint: Callable[[int], CheckpointHandle]) -> CheckpointHandle | None:
        """``checkpoint(step)`` if ``step`` is due, timed from this call; its handle, else None."""
        requested = time.perf_counter()
        if not self.due(step, requested):
            return None
        handle = checkpoint(step)
        self.taken(step, handle, requested)
        return handle

    def due(self, step: int, now: float) -> bool:
        """Whether ``step`` (the call at ``now``, once per training step) is to be checkpointed."""
        self._observe(now)
        if isinstance(self.every, int):
            return step % self.every == 0
        if self._flushed(step):
            return True
        if self._next is None:
            return self._calls > self.warmup
        return step >= self._next

    def taken(self, step: int, handle: CheckpointHandle, requested: float) -> None:
        """``handle`` is the checkpoint of ``step``, requested by the call at ``requested``: time it, and agree
        on when the next automatic one is (collective with many ranks)."""
        if isinstance(self.every, int):
            return
        # One of each timed at a time (one in flight, its span all its own): a checkpoint into memory alone, or one
        # a flush tier receives, until every copy is made.
        if self._flushed(step):
            if self._flushing is None:
                self._flushing = _Open(handle, requested)
        elif self._open is None:
            self._open = _Open(handle, requested)
        self._busy.append(handle)
        self.interval = max(self.agree(self._proposal()))
        self._next = step + self.interval

    def _flushed(self, step: int) -> bool:
        """Whether a flush tier receives ``step`` (so it is always checkpointed)."""
        return any(step % every == 0 for every in self.forced)

    def _observe(self, now: float) -> None:
        """This call ends a step: a sample of the plain step time, or one more step of the checkpoint timed."""
        self._calls += 1
        last, self._last_call = self._last_call, now
        self._busy = [h for h in self._busy if not _settled(h)]
        if last is None:
            return
        timing = self._open is not None or self._flushing is not None  # this step overlapped one timed
        if self._open is not None:
            self._open.steps += 1
            if self._open.handle.done():  # durable on the persist tier (or failed, or skipped)
                self._costs.append((now - self._open.started, self._open.steps))
                self._open = None
        if self._flushing is not None:
            self._flushing.steps += 1
            if _settled(self._flushing.handle):
                self._flush_costs.append((now - self._flushing.started, self._flushing.steps))
                self._flushing = None
        if not timing and not self._busy:
            self._steps.append(now - last)

    def _proposal(self) -> int:
        """This rank's interval: from its measurements, or twice the last one while it has none to go by."""
        timed = self._costs or self._flush_costs  # a flushed checkpoint's cost bounds its part in memory
        if not timed or not self._steps:
            return max(1, self.warmup, 2 * self.interval)
        step = statistics.median(self._steps)
        cost = _median_cost(timed, step)
        durable = max(s for _, s in timed)
        if step <= 0:
            return max(1, durable)
        left = self.budget * step  # per step, for the checkpoints into memory
        if self._flush_costs:  # a flushed checkpoint in place of one into memory every ``every`` steps
            flushed, per_step = _median_cost(self._flush_costs, step), sum(1 / every for every in self.forced)
            left -= max(0.0, flushed - cost) * per_step
            if left <= 0:
                self._warn_flushes_over_budget(flushed * per_step / step)
                return max(1, durable, max(self.forced))
        return max(1, durable, math.ceil(cost / left))

    def _warn_flushes_over_budget(self, spent: float) -> None:
        """Say once that the flushed checkpoints take ``spent`` of the training time, over the budget."""
        if self._warned:
            return
        self._warned = True
        log.warning(
            "cadence: the flushes every %s steps cost %.1f%% of training alone, over the budget of %.1f%%: "
            "only their steps are checkpointed; raise flush.every about %.1fx for checkpoints in between",
            "/".join(str(e) for e in self.forced), 100 * spent, 100 * self.budget, spent / self.budget,
        )  # fmt: skip


def cadence_of(config: PipelineConfig, group: CheckpointGroup | None) -> Cadence:
    """The cadence ``config`` asks for, its intervals agreed among the ranks of ``group`` (None: one process)."""
    forced = sorted({edge.policy.every for edge in config.flush_graph().edges if edge.policy.every > 1})
    settings = config.cadence
    agree = group.side_gather("cadence: the next interval") if group is not None else _alone
    return Cadence(settings.every, settings.budget, settings.warmup, forced, agree)


def _settled(handle: CheckpointHandle) -> bool:
    """Whether every copy ``handle``'s checkpoint is due is made (or failed): persist and every flush."""
    return all(f.done() for f in handle.tier_futures.values())


def _median_cost(spans: Sequence[tuple[float, int]], step: float) -> float:
    """What the timed checkpoints cost beyond their steps: the median of each span less as many plain steps."""
    return max(0.0, statistics.median(span - steps * step for span, steps in spans))


def _alone(proposal: int) -> list[int]:
    return [proposal]
