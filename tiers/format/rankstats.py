"""What writing one rank's part of a checkpoint cost, as stored in its manifest (``stats``).

Informative only (see pipeline/metrics.py, which measures it, and ``tierstate stats``, which shows
it): a reader never trusts it for finding bytes.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from .strict import Measure, NonNegative, Strict


class StageStatsRecord(Strict):
    """One pipeline stage of one rank: units through it, bytes out of it, wall and busy seconds."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    units: NonNegative
    bytes: NonNegative
    seconds: Measure
    busy_s: Measure
    gbps: Measure
    queue_peak: NonNegative
    queue_bound: NonNegative
    passed_units: NonNegative = 0  # of ``units``, those handed past it untouched (none before this field)


class TimelineEvent(Strict):
    """One interval of a rank's checkpoint, in seconds from the request: a stage's work on one unit (or a
    unit passed through it), a wait for a host-cache slab, the trainer blocked; for ``tierstate stats --trace``."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    thread: Annotated[str, Field(max_length=256)]
    start: Measure
    end: Measure
    bytes: NonNegative = 0


MAX_TIMELINE = 20_000  # events kept per rank and checkpoint: ~4 per chunk, so a few TB at 64 MiB chunks


class RankStatsRecord(Strict):
    """What writing one rank's part cost, as that rank measured it (see pipeline/metrics.py).

    Informative only: a reader never trusts it for finding bytes, so it is not checked against the
    data. Seconds count from the request; written just before the commit, so the commit is not in them.
    """

    raw_bytes: NonNegative
    stored_bytes: NonNegative
    chunks: NonNegative
    capture_s: Measure
    written_s: Measure
    blocked_s: Measure
    cache_wait_s: Measure
    eager_tensors: NonNegative
    eager_bytes: NonNegative
    stages: list[StageStatsRecord]  # in chain order
    timeline: Annotated[list[TimelineEvent], Field(max_length=MAX_TIMELINE)] = []  # none before this field

    @model_serializer(mode="wrap")
    def _empty_timeline_left_out(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No ``timeline`` key when there is none: the JSON of an older checkpoint is written as it was."""
        body: dict[str, Any] = dump(self)
        if not self.timeline:
            body.pop("timeline", None)
        return body
