"""What each checkpoint cost, where people look: on its handle, in one log record, in the manifest.

A :class:`CheckpointStats` is filled in while its checkpoint runs: the trainer's side (seconds it
was blocked, tensors copied before ``checkpoint()`` returned) by the handle's completer, the
pipeline's side (bytes, seconds and GB/s per stage, queue peaks, time capture waited for a free
host-cache slab) by the job. It is final once the handle is done. The job writes it into the
manifest just before the commit (:meth:`CheckpointStats.manifest_body`), so ``tierstate stats``
shows what a checkpoint cost long after the run; the runner logs it as one structured record
(``extra={"tierstate": stats.as_dict()}``) and sums it into :class:`RunMetrics`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ..tiers.format.rankstats import MAX_TIMELINE
from .laziness import EagerSnapshot

Outcome = Literal["in flight", "durable", "failed", "skipped"]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


class Timeline:
    """Intervals of one checkpoint on this rank (monotonic seconds), for ``tierstate stats --trace``: each
    stage's work on a unit and each unit passed through it (by worker thread), waits for a host-cache
    slab, the trainer's blocked calls and waits. Appends come from the stage threads without a lock
    (``list.append`` is atomic); past :data:`~tiers.format.rankstats.MAX_TIMELINE` events the rest are dropped."""

    def __init__(self) -> None:
        self.origin = time.monotonic()  # the request
        self.events: list[tuple[str, str, float, float, int]] = []

    def add(self, name: str, started: float, ended: float, nbytes: int = 0, thread: str | None = None) -> None:
        if len(self.events) < MAX_TIMELINE:
            who = threading.current_thread().name if thread is None else thread
            self.events.append((name, who, started, ended, nbytes))

    def records(self) -> list[dict[str, Any]]:
        """The events as the manifest keeps them: seconds from the request, never before it."""
        return [
            {"name": name, "thread": thread, "start": round(max(0.0, start - self.origin), 6),
             "end": round(max(0.0, end - self.origin), 6), "bytes": nbytes}
            for name, thread, start, end, nbytes in self.events
        ]  # fmt: skip


@dataclass
class StageStats:
    """One stage of the pipeline: units through it, bytes out of it, and its time.

    ``seconds`` is wall time from its first unit's start to its last unit's end (its workers
    overlap); ``busy_s`` the time its workers spent on units, summed (waits for the host cache or
    the disk included). ``queue_peak`` is the most units its input queue held, out of ``queue_bound``.
    """

    units: int = 0
    bytes: int = 0
    seconds: float = 0.0
    busy_s: float = 0.0
    queue_peak: int = 0
    queue_bound: int = 0
    passed_units: int = 0  # of ``units``, those it handed on untouched, never queued for its workers
    _span: tuple[float, float] | None = field(default=None, repr=False, compare=False)
    # Where its units' intervals go (the checkpoint's timeline), under this stage's name; None: nowhere.
    timeline: Timeline | None = field(default=None, repr=False, compare=False)
    name: str = field(default="", repr=False, compare=False)

    @property
    def gbps(self) -> float:
        return _gbps(self.bytes, self.seconds)

    def unit_done(self, started: float, ended: float, nbytes: int) -> None:
        """A worker spent ``started..ended`` (monotonic seconds) on one unit that put out ``nbytes``."""
        first, last = self._span or (started, ended)
        self._span = (min(first, started), max(last, ended))
        self.seconds = self._span[1] - self._span[0]
        self.units += 1
        self.bytes += nbytes
        self.busy_s += ended - started
        if self.timeline is not None:
            self.timeline.add(self.name, started, ended, nbytes)

    def passed(self, nbytes: int) -> None:
        """A unit of ``nbytes`` went past this stage, which had nothing to do on it (job.py ``_passes``)."""
        self.units += 1
        self.passed_units += 1
        self.bytes += nbytes
        if self.timeline is not None:
            now = time.monotonic()
            self.timeline.add(f"{self.name} (passed)", now, now, nbytes)

    def queued(self, size: int) -> None:
        self.queue_peak = max(self.queue_peak, size)

    def merge(self, other: StageStats) -> None:
        """Add ``other`` (the same stage of another checkpoint) into this running total."""
        self.units += other.units
        self.passed_units += other.passed_units
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.busy_s += other.busy_s
        self.queue_peak = max(self.queue_peak, other.queue_peak)
        self.queue_bound = max(self.queue_bound, other.queue_bound)

    def as_dict(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "passed_units": self.passed_units,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
            "busy_s": round(self.busy_s, 6),
            "gbps": round(self.gbps, 3),
            "queue_peak": self.queue_peak,
            "queue_bound": self.queue_bound,
        }


@dataclass
class CheckpointStats:
    """One checkpoint's costs; ``handle.stats``. Final once the handle is done; read, never write it.

    Seconds count from the request: ``capture_s`` until every tensor byte was in the host cache (the
    optimizer may step from then on), ``written_s`` until this rank's files were fsynced (just before
    the commit), ``durable_s`` until committed. ``blocked_s``: the trainer's time in ``checkpoint()``
    and in the optimizer step pre-hook waiting for this capture. ``cache_wait_s``: capture's time
    waiting for a free host-cache slab (summed over its workers), backpressure from slower stages.
    """

    step: int
    outcome: Outcome = "in flight"
    raw_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    capture_s: float = 0.0
    written_s: float = 0.0
    durable_s: float = 0.0
    blocked_s: float = 0.0
    cache_wait_s: float = 0.0
    eager: EagerSnapshot = EagerSnapshot(0, 0, ())
    stages: dict[str, StageStats] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=Timeline, repr=False, compare=False)

    @property
    def gbps(self) -> float:
        """Raw bytes per second from the request until durable."""
        return _gbps(self.raw_bytes, self.durable_s)

    @property
    def queue_peaks(self) -> dict[str, int]:
        """Per stage, the most units its input queue held."""
        return {name: stage.queue_peak for name, stage in self.stages.items()}

    @property
    def queue_bounds(self) -> dict[str, int]:
        return {name: stage.queue_bound for name, stage in self.stages.items()}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the log record's ``tierstate`` field, and what the CLI prints."""
        durable = {"durable_s": round(self.durable_s, 6), "gbps": round(self.gbps, 3)}
        body = self.manifest_body()
        del body["timeline"]  # the manifest keeps it (``tierstate stats --trace``); a log record would drown in it
        return {"step": self.step, "outcome": self.outcome, **body, **durable}

    def figures(self, prefix: str = "tierstate/") -> dict[str, float]:
        """The few numbers a dashboard plots per checkpoint, flat, under ``prefix``: what the HF callback
        hands ``Trainer.log`` and the Lightning plugin the module's loggers (TensorBoard, W&B, MLflow)."""
        figures = {
            "step": self.step,
            "blocked_s": round(self.blocked_s, 6),
            "durable_s": round(self.durable_s, 6),
            "gbps": round(self.gbps, 3),
            "bytes": self.raw_bytes,
            "failures": int(self.outcome == "failed"),
        }
        return {f"{prefix}{name}": value for name, value in figures.items()}

    def manifest_body(self) -> dict[str, Any]:
        """This rank's record in the manifest's ``stats`` (tiers/format/rankstats.py: ``RankStatsRecord``), JSON
        form; written before the commit, so without the seconds to durable."""
        return {
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "chunks": self.chunks,
            "capture_s": round(self.capture_s, 6),
            "written_s": round(self.written_s, 6),
            "blocked_s": round(self.blocked_s, 6),
            "cache_wait_s": round(self.cache_wait_s, 6),
            "eager_tensors": self.eager.tensors,
            "eager_bytes": self.eager.nbytes,
            "stages": _stage_list(self.stages),
            "timeline": self.timeline.records(),
        }


def _stage_list(stages: dict[str, StageStats]) -> list[dict[str, Any]]:
    """Stages in chain order, as a list: JSON objects have no order, the pipeline does."""
    return [{"name": name, **stage.as_dict()} for name, stage in stages.items()]


@dataclass
class RunMetrics:
    """Every checkpoint a runner was asked for since it was built, summed: ``runner.metrics()``.

    Bytes and seconds to durable count durable checkpoints only; blocked time counts all of them
    (a skipped request still cost the trainer its call). ``stages`` sums each stage over the
    durable checkpoints (its ``queue_peak`` is the highest seen); ``last`` is the newest finished one.
    """

    requested: int = 0
    durable: int = 0
    failed: int = 0
    skipped: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    durable_s: float = 0.0
    blocked_s: float = 0.0
    blocked_max_s: float = 0.0
    cache_wait_s: float = 0.0
    stages: dict[str, StageStats] = field(default_factory=dict)
    last: CheckpointStats | None = None

    @property
    def gbps(self) -> float:
        """Raw bytes of the durable checkpoints per second each took to become durable."""
        return _gbps(self.raw_bytes, self.durable_s)

    @property
    def blocked_mean_s(self) -> float:
        return self.blocked_s / self.requested if self.requested else 0.0

    def add(self, stats: CheckpointStats) -> None:
        """Count one finished checkpoint (its outcome set)."""
        self.requested += 1
        self.blocked_s += stats.blocked_s
        self.blocked_max_s = max(self.blocked_max_s, stats.blocked_s)
        self.last = stats
        if stats.outcome == "failed":
            self.failed += 1
        elif stats.outcome == "skipped":
            self.skipped += 1
        if stats.outcome != "durable":
            return
        self.durable += 1
        self.raw_bytes += stats.raw_bytes
        self.stored_bytes += stats.stored_bytes
        self.durable_s += stats.durable_s
        self.cache_wait_s += stats.cache_wait_s
        for name, stage in stats.stages.items():
            self.stages.setdefault(name, StageStats()).merge(stage)

    def copy(self) -> RunMetrics:
        """A snapshot the runner's later checkpoints do not change."""
        stages = {name: dataclasses.replace(stage) for name, stage in self.stages.items()}
        return dataclasses.replace(self, stages=stages)

    def flat(self) -> dict[str, float]:
        """Every number of :meth:`as_dict` as ``{name: number}``, stages as ``stage_<name>_<field>`` and the
        newest checkpoint's as ``last_<field>``: for metric systems that take flat names."""
        flat: dict[str, float] = {k: v for k, v in self.as_dict().items() if isinstance(v, int | float)}
        for name, stage in self.stages.items():
            flat |= {f"stage_{name}_{k}": v for k, v in stage.as_dict().items() if isinstance(v, int | float)}
        if self.last is not None:
            flat |= {f"last_{k.removeprefix('tierstate/')}": v for k, v in self.last.figures().items()}
        return flat

    def prometheus(self, namespace: str = "tierstate") -> str:
        """The run's metrics in Prometheus' text exposition format (for a textfile collector or an HTTP
        handler): counts as counters, the rest as gauges, stages under a ``stage`` label."""
        lines: list[str] = []
        for name, value in self.flat().items():
            if name.startswith("stage_"):
                continue
            metric = f"{namespace}_{name}"
            kind = "counter" if name in _COUNTERS else "gauge"
            lines += [f"# TYPE {metric} {kind}", f"{metric} {_number(value)}"]
        rows = {name: {k: v for k, v in stage.as_dict().items() if isinstance(v, int | float)}
                for name, stage in self.stages.items()}  # fmt: skip
        for field_name in sorted({k for row in rows.values() for k in row}):
            metric = f"{namespace}_stage_{field_name}"
            lines.append(f"# TYPE {metric} gauge")
            lines += [f'{metric}{{stage="{name}"}} {_number(row[field_name])}' for name, row in rows.items()
                      if field_name in row]  # fmt: skip
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "durable": self.durable,
            "failed": self.failed,
            "skipped": self.skipped,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "durable_s": round(self.durable_s, 6),
            "gbps": round(self.gbps, 3),
            "blocked_s": round(self.blocked_s, 6),
            "blocked_mean_s": round(self.blocked_mean_s, 6),
            "blocked_max_s": round(self.blocked_max_s, 6),
            "cache_wait_s": round(self.cache_wait_s, 6),
            "stages": _stage_list(self.stages),
            "last": None if self.last is None else self.last.as_dict(),
        }


#: RunMetrics fields that only grow over a run: Prometheus counters (the rest are gauges).
_COUNTERS = frozenset({"requested", "durable", "failed", "skipped", "raw_bytes", "stored_bytes", "durable_s",
                       "blocked_s", "cache_wait_s"})  # fmt: skip


def _number(value: float) -> str:
    """A sample value as the exposition format writes it (integers without a fraction)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
