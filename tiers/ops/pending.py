"""Flushes a crash left undone: committed copies due on a later tier that the tier has not received.

A runner copies each checkpoint on along the flush graph once it commits (pipeline/flush.py). A
process killed before those copies were published leaves the step on the faster tier only, where
retention keeps it (the copy that feeds a tier the step is due on, :mod:`tiers.ops.due`). Nothing would
copy it on, so it would stay pinned: the PFS or the bucket would never get it, and a bounded memory
tier would fill with such copies until every later checkpoint failed. What is due is a function of
the tiers, their flush graph and the receipts alone (:mod:`tiers.ops.due`), so a restarted runner and
``tierstate flush`` find those steps here and copy them on, oldest first, each from the copy nearest
its target.

A copy whose flush fails because it is itself damaged (a frame or its manifest no longer matches its
checksum, confirmed by a full verification) can never be flushed: it is noted as unflushable for
that tier (:func:`tiers.ops.due.record_unflushable`), reported once, and retention then treats it
by its tier's rule. Any other failure (the target full or down) leaves it pinned, to be tried again.

Only the writer of a source tier resumes its flushes (:func:`tiers.storage.locks.claim_tier`): two
processes started on the same tiers do not both copy the same step (their copies into one
``step-N.partial`` would also meet the partial's exclusive lock, see :mod:`tiers.ops.migrate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..format.format import ManifestError
from ..reading.pieces import CorruptCheckpointError
from ..storage.filesystem import FilesystemTier
from ..storage.locks import claim_tier
from ..storage.tier import Tier
from .due import copies_of, fed_by, holdings, record_receipt, record_unflushable
from .migrate import MigrateReport
from .pacing import Pacer
from .policy import FlushGraph
from .retention import BucketPolicies, Decision, TierPolicies, collect_garbage, graph_of, prune
from .transfer import transfer
from .verify import verify_step

log = logging.getLogger("tierstate")

# What a flush raises when the source copy itself is bad; confirmed by a verification before giving up.
_SOURCE_DAMAGE = (CorruptCheckpointError, ManifestError)


@dataclass(frozen=True)
class PendingFlush:
    """Committed ``step``, held by ``source`` (the copy nearest them), not yet on the tiers ``targets``."""

    step: int
    source: FilesystemTier
    targets: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {"step": self.step, "source": self.source.name, "due_on": list(self.targets)}


def pending_flushes(
    policies: Sequence[TierPolicies], source: str | None = None, graph: FlushGraph | None = None
) -> list[PendingFlush]:
    """The committed steps some tier is due to receive and has not, oldest first, each from the copy that
    feeds it among ``policies``' tiers (fastest first); only those ``source`` holds when given. ``graph``:
    the flush graph (tiers/ops/due.py), by default that of ``policies`` alone."""
    graph = graph_of(policies) if graph is None else graph
    tiers = [p.tier for p in policies]
    held = holdings(tiers)
    found = []
    for step in sorted(set().union(*held.values())):
        copies = copies_of(step, tiers, held)
        for name, tier in copies.tiers.items():
            due = fed_by(graph, name, copies) if source in (None, name) else []
            if due:
                found.append(PendingFlush(step, tier, tuple(due)))
    return found


def mark_pending(
    entries: list[dict[str, Any]], policies: Sequence[TierPolicies], graph: FlushGraph | None = None
) -> list[dict[str, Any]]:
    """``tierstate ls`` entries, each copy a pending flush would start from given ``due_on``: the tiers
    due to receive it that have not (a crashed run's flushes, or flushes still running)."""
    due = {(p.source.name, p.step): list(p.targets) for p in pending_flushes(policies, graph=graph)}
    for entry in entries:
        targets = due.get((entry["tier"], entry["step"]))
        if targets:
            entry["due_on"] = targets
    return entries


def note_received(
    tiers: Sequence[FilesystemTier], step: int, receiver: str, source: FilesystemTier, graph: FlushGraph
) -> None:
    """``receiver`` published ``step`` from ``source``'s copy: the receipt goes into every copy of that very
    checkpoint among ``tiers`` that ``receiver`` is downstream of (the copies that could be taken as due
    there), so that none of them is once ``receiver`` lets it go, whichever copy the flush read.

    A copy that cannot take the note (read-only, full, gone meanwhile) stays pinned: the safe side, and no
    reason to fail a copy that is published and verified.
    """
    try:
        published = source.manifest(step)
    except (OSError, ManifestError):
        return
    for tier in tiers:
        if not graph.carries(tier.name, receiver, step) and tier.name != source.name:
            continue
        try:
            if tier.name == source.name or tier.manifest(step).same_checkpoint(published):
                record_receipt(tier, step, receiver)
        except (OSError, ManifestError):
            continue


def give_up_if_damaged(source: FilesystemTier, step: int, receiver: str, error: BaseException) -> str | None:
    """After a flush of ``source``'s ``step`` to ``receiver`` failed with ``error``: if the copy itself is
    damaged (a full verification agrees), note it unflushable there and return the first problem found;
    None when the failure lies elsewhere (the copy stays pinned, the flush may be tried again)."""
    if not isinstance(error, _SOURCE_DAMAGE):
        return None
    try:
        result = verify_step(source, step)  # also stamps the copy damaged, as ls then shows
    except OSError:
        return None  # gone meanwhile, or unreadable as a whole: nothing to decide about here
    if result.ok:
        return None
    problem = str(result.problems[0])
    try:
        record_unflushable(source, step, receiver, problem)
    except OSError as exc:  # the copy stays pinned; still reported as damaged
        log.error("tier %s step %d: could not note it unflushable to %s: %s", source.name, step, receiver, exc)
    return problem


@dataclass
class FlushOutcome:
    """What ``tierstate flush`` did with one pending step on one tier."""

    step: int
    source: str
    target: str
    report: MigrateReport | None = None
    error: str | None = None
    damaged: str | None = None  # the source is damaged: noted unflushable, retention may free it

    def as_dict(self) -> dict[str, object]:
        done = None if self.report is None else self.report.as_dict()
        return {"step": self.step, "source": self.source, "target": self.target, "report": done,
                "error": self.error, "damaged": self.damaged}  # fmt: skip


@dataclass
class FlushRun:
    """``tierstate flush``: each pending step's outcomes, then what retention did."""

    outcomes: list[FlushOutcome] = field(default_factory=list)
    pruned: list[Decision] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(o.error is not None for o in self.outcomes)


def flush_pending(
    tiers: Sequence[TierPolicies],
    buckets: Sequence[BucketPolicies] = (),
    pacers: Mapping[str, Pacer] | None = None,
    each: Callable[[FlushOutcome], None] | None = None,
) -> FlushRun:
    """Every pending flush along the flush graph of ``tiers`` and ``buckets``, oldest first, each from the copy
    nearest its target (each target as its own outcome, passed to ``each`` as it ends), then retention on
    every tier. Each target is paced by its pacer in ``pacers`` (by target name; default: one per target at
    its flush ``bandwidth``). Takes no lock of its own: a copy into a tier goes through that step's partial
    directory, which two copies never share (tiers/ops/migrate.py), and retention never deletes what is read."""
    run = FlushRun()
    graph = graph_of(tiers, [(b.tier.name, b.flush) for b in buckets])
    pending = pending_flushes(tiers, graph=graph)
    targets: Mapping[str, Tier] = {**{p.tier.name: p.tier for p in tiers}, **{b.tier.name: b.tier for b in buckets}}
    if pacers is None:
        pacers = {edge.target: Pacer(edge.policy.bandwidth) for edge in graph.edges}
    for item in pending:
        for name in item.targets:
            outcome = FlushOutcome(item.step, item.source.name, name)
            try:
                outcome.report = transfer(item.step, item.source, targets[name], pacer=pacers[name])
                note_received([p.tier for p in tiers], item.step, name, item.source, graph)
            except Exception as exc:  # reported per step; the other steps are still flushed
                outcome.error = f"{type(exc).__name__}: {exc}"
                outcome.damaged = give_up_if_damaged(item.source, item.step, name, exc)
            run.outcomes.append(outcome)
            if each is not None:
                each(outcome)
    run.pruned = prune(tiers, graph=graph)
    return run


def flush_by_hand(
    tiers: Sequence[TierPolicies],
    buckets: Sequence[BucketPolicies] = (),
    pacer: Pacer | None = None,
    each: Callable[[FlushOutcome], None] | None = None,
) -> FlushRun:
    """What a restarted runner does in the background, in the foreground (``tierstate flush``):
    :func:`flush_pending`, each target paced to its flush ``bandwidth``, or all of them together to ``pacer``
    when given.

    Holds the writer lock of each source tier meanwhile: InUseError (naming the host and pid) if a
    runner writes it, since that runner resumes these flushes itself. Leftover partial directories on
    a source tier are removed then (nobody writes them while its writer lock is held here).
    """
    graph = graph_of(tiers, [(b.tier.name, b.flush) for b in buckets])
    sources = {p.source.name: p.source for p in pending_flushes(tiers, graph=graph)}
    pacers = {edge.target: pacer for edge in graph.edges} if pacer is not None else None
    claims = []
    try:
        for tier in sources.values():
            claims.append(claim_tier(tier.root, tier.owner))
            collect_garbage([tier], older_than=0)
        return flush_pending(tiers, buckets, pacers, each)
    finally:
        for claim in claims:
            claim.release()
