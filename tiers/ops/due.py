"""What is due where: the one rule that flushes, resumed flushes, ``tierstate flush``, ``ls`` and retention ask.

The YAML's ``flush`` entries form a graph from faster to slower tiers: a tier with a ``flush`` policy
receives, from one source tier (``flush.from``; by default the tier the pipeline persists to), the
checkpoints whose step the policy selects. Sources are listed before their targets (tiers go
fastest first, buckets last), so the graph has no cycle and a flush never goes towards a faster tier.

A copy of step N on tier X is *due* on tier T iff

- T is downstream of X: reached by following flush edges from X;
- every edge on the way selects N (``every``); a step one hop skips goes no further down that way;
- T has not received that checkpoint: T does not hold step N, and no copy of the step carries T's
  receipt (``received-T.json``, written into every copy of the step once T publishes it, whichever
  copy the flush read from, so that every copy agrees) or T's unflushable note (the copy is damaged,
  so T can never get it from there; see :mod:`tiers.ops.pending`).

Of a step's copies the one that *feeds* T is the nearest: the holder furthest along the path to T
(in memory -> nvme -> pfs, the NVMe copy once there is one). Retention keeps a copy that feeds a tier
the step is due on, and lets the other copies go by their own rule; ``ls`` marks that copy ``flush
pending``; a resumed flush and ``tierstate flush`` read it.

A bucket (``kind: s3``) is a target like any directory, but its holdings are never listed here (a
listing is a request): a bucket has received a step when a copy carries its receipt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..format.format import now_iso
from ..storage.filesystem import FilesystemTier
from ..storage.safeopen import write_durably
from .policy import FlushGraph

RECEIPT_PREFIX = "received-"
UNFLUSHABLE_PREFIX = "unflushable-"


def _receipt(directory: Path, receiver: str, prefix: str = RECEIPT_PREFIX) -> Path:
    return directory / f"{prefix}{receiver}.json"


def record_receipt(holder: FilesystemTier, step: int, receiver: str) -> None:
    """Note in ``holder``'s copy of ``step`` that tier ``receiver`` published it.

    The note lives and dies with that copy, and says which checkpoint was received, not which step
    number: a step number that a rolled-back run commits again is a new copy without receipts.
    """
    body = {"tier": receiver, "received_at": now_iso()}
    write_durably(_receipt(holder.step_dir(step), receiver), json.dumps(body).encode())


def record_unflushable(holder: FilesystemTier, step: int, receiver: str, problem: str) -> None:
    """Note in ``holder``'s copy of ``step`` that it can never be flushed to ``receiver``: the copy is
    damaged (``problem`` says where). Retention then no longer pins it for ``receiver``, and nobody
    tries the flush again; like a receipt, the note goes with the copy."""
    body = {"tier": receiver, "given_up_at": now_iso(), "problem": problem}
    write_durably(_receipt(holder.step_dir(step), receiver, UNFLUSHABLE_PREFIX), json.dumps(body).encode())


def receipts(holder: FilesystemTier, step: int) -> list[str]:
    """The tiers ``holder``'s copy of ``step`` says received it."""
    try:
        names = [p.name for p in holder.step_dir(step).iterdir()]
    except OSError:
        return []
    return sorted(n.removeprefix(RECEIPT_PREFIX).removesuffix(".json") for n in names
                  if n.startswith(RECEIPT_PREFIX) and n.endswith(".json"))  # fmt: skip


@dataclass(frozen=True)
class StepCopies:
    """Where one step is held now, among the directory tiers looked at: their names, fastest first."""

    step: int
    tiers: Mapping[str, FilesystemTier]  # holder name -> tier

    def received(self, receiver: str) -> bool:
        """Whether ``receiver`` holds the step, or a copy carries its receipt or its unflushable note."""
        if receiver in self.tiers:
            return True
        return any(
            _receipt(tier.step_dir(self.step), receiver, prefix).is_file()
            for tier in self.tiers.values()
            for prefix in (RECEIPT_PREFIX, UNFLUSHABLE_PREFIX)
        )


def due_on(graph: FlushGraph, holder: str, copies: StepCopies) -> list[str]:
    """The tiers ``holder``'s copy of the step is due on: downstream, selected on the way, not received."""
    step = copies.step
    return [
        edge.target
        for edge in graph.edges
        if graph.carries(holder, edge.target, step) and not copies.received(edge.target)
    ]


def fed_by(graph: FlushGraph, holder: str, copies: StepCopies) -> list[str]:
    """The tiers due to receive the step from ``holder``'s copy, the nearest to them: retention keeps that
    copy for them, ``ls`` marks it pending, a resumed flush reads it."""
    return [t for t in due_on(graph, holder, copies) if graph.feeder(t, copies.step, copies.tiers) == holder]


def holdings(tiers: Sequence[FilesystemTier]) -> dict[str, set[int]]:
    """Each directory tier's committed steps (one listing each)."""
    return {tier.name: set(tier.steps()) for tier in tiers}


def copies_of(step: int, tiers: Sequence[FilesystemTier], held: Mapping[str, set[int]]) -> StepCopies:
    """The copies of ``step`` among ``tiers`` (fastest first), by the listing ``held``."""
    return StepCopies(step, {tier.name: tier for tier in tiers if step in held[tier.name]})
