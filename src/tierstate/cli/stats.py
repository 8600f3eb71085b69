"""``tierstate stats PATH``: what a checkpoint cost, read from its manifest.

The runner records, per rank, what writing its part cost (pipeline/metrics.py) in the manifest's
``stats`` just before the commit: bytes, seconds from the request to capture and to the files
fsynced, the trainer's blocked time, the wait for host-cache slabs, and per stage its units (and how
many of them it passed on with nothing to do), bytes, wall and busy seconds, GB/s and queue peak.
This renders it, long after the run, from the files alone. A checkpoint written before stats were
recorded has none, which is said, not an error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..pipeline.trace import chrome_trace
from ..tiers.format.manifest import Manifest
from ..tiers.format.rankstats import RankStatsRecord
from ..tiers.reading.stored import Location, StoredCheckpoint
from .tables import columns

_COLUMNS = ("stage", "units", "passed", "bytes", "seconds", "busy s", "GB/s", "queue peak/bound")


def stats_document(manifest: Manifest) -> dict[str, Any]:
    """The manifest's stats as JSON: ``{"step", "ranks": {rank: record} | None}``."""
    ranks = None if manifest.stats is None else {rank: s.model_dump() for rank, s in sorted(manifest.stats.items())}
    return {"step": manifest.step, "ranks": ranks}


def stats_lines(manifest: Manifest) -> list[str]:
    """Plain lines: a summary per rank, then a row per stage in padded columns."""
    head = f"step {manifest.step}: {manifest.raw_bytes:,} bytes raw, {manifest.stored_bytes:,} bytes in its files"
    if manifest.stats is None:
        return [head, "no stats recorded (written before tierstate recorded them)"]
    lines = [head]
    for rank, record in sorted(manifest.stats.items()):
        lines += _rank_lines(rank, record)
    return lines


def _rank_lines(rank: int, record: RankStatsRecord) -> list[str]:
    eager = (
        f", {record.eager_tensors} tensors ({record.eager_bytes:,} bytes) copied before checkpoint() returned"
        if record.eager_tensors
        else ""
    )
    summary = [
        f"rank {rank}: {record.raw_bytes:,} bytes in {record.chunks} chunks, {record.stored_bytes:,} stored",
        f"  captured after {record.capture_s:.3f} s, written after {record.written_s:.3f} s "
        f"({_gbps(record.raw_bytes, record.written_s)} GB/s)",
        f"  trainer blocked {record.blocked_s * 1e3:.1f} ms{eager}; capture waited {record.cache_wait_s:.3f} s "
        "for host-cache slabs",
    ]
    rows = [
        (s.name, str(s.units), str(s.passed_units), f"{s.bytes:,}", f"{s.seconds:.3f}", f"{s.busy_s:.3f}",
         f"{s.gbps:.2f}", f"{s.queue_peak}/{s.queue_bound}")
        for s in record.stages
    ]  # fmt: skip
    return summary + ["  " + line for line in columns(_COLUMNS, rows, right=_COLUMNS[1:])]


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "-"


def show_stats(location: Location, as_json: bool, trace: str | None = None) -> int:
    """Print what the checkpoint at ``location`` (a directory or a bucket prefix) cost; exit code 0
    (ManifestError if it is no checkpoint). ``trace``: also write its timeline there, as a
    Chrome/Perfetto trace (pipeline/trace.py)."""
    manifest = StoredCheckpoint(location).manifest
    print(json.dumps(stats_document(manifest), indent=1) if as_json else "\n".join(stats_lines(manifest)))
    if trace is not None:
        print(write_trace(manifest, Path(trace)), file=sys.stderr if as_json else sys.stdout)
    return 0


def write_trace(manifest: Manifest, out: Path) -> str:
    """Write the checkpoint's timeline to ``out`` as a Chrome/Perfetto trace; the line that says so."""
    document = chrome_trace(manifest)
    out.write_text(json.dumps(document))
    events = sum(1 for event in document["traceEvents"] if event["ph"] != "M")
    return f"trace: {events} events in {out} (open it in ui.perfetto.dev or chrome://tracing)"
