"""Flushes a crash left undone: committed copies due on a later tier that the tier has not received.

A runner copies each checkpoint on to every tier whose flush policy selects its step once it
commits (pipeline/flush.py). A process killed before those copies were published leaves the step
on the faster tier only, where retention keeps it (the last copy of a step a tier is due to
receive). Nothing would copy it on, so it would stay pinned: the PFS would never get it, and a
bounded memory tier would fill with such copies until every later checkpoint failed. What is due
is a function of the tiers and their policies alone (the same rule retention applies,
:func:`tiers.retention.due_on`), so a restarted runner and ``tierstate flush`` find those steps
here and copy them on, oldest first.

A copy whose flush fails because it is itself damaged (a frame or its manifest no longer matches its
checksum, confirmed by a full verification) can never be flushed: it is noted as unflushable for
that tier (:func:`tiers.retention.record_unflushable`), reported once, and retention then treats it
by its tier's rule. Any other failure (the target full or down) leaves it pinned, to be tried again.

Only the writer of the source tier resumes its flushes (:func:`tiers.locks.claim_tier`): two
processes started on the same tiers do not both copy the same step (their copies into one
``step-N.partial`` would also meet the partial's exclusive lock, see :mod:`tiers.migrate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .filesystem import FilesystemTier
from .format import ManifestError
from .locks import claim_tier
from .migrate import MigrateReport, migrate
from .pacing import Pacer
from .pieces import CorruptCheckpointError
from .retention import Decision, TierPolicies, collect_garbage, due_on, prune, record_unflushable
from .verify import verify_step

log = logging.getLogger("tierstate")

# What a flush raises when the source copy itself is bad; confirmed by a verification before giving up.
_SOURCE_DAMAGE = (CorruptCheckpointError, ManifestError)


@dataclass(frozen=True)
class PendingFlush:
    """Committed ``step``, held by ``source`` (its fastest holder), not yet on the tiers ``targets``."""

    step: int
    source: FilesystemTier
    targets: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {"step": self.step, "source": self.source.name, "due_on": list(self.targets)}


def pending_flushes(tiers: Sequence[TierPolicies], source: str | None = None) -> list[PendingFlush]:
    """The committed steps some tier is due to receive and has not, oldest first; each from its fastest
    holder among ``tiers`` (fastest first), or only those ``source`` holds (the runner's persist tier)."""
    holdings = {p.tier.name: set(p.tier.steps()) for p in tiers}
    found = []
    for step in sorted(set().union(*holdings.values())):
        holders = [p for p in tiers if step in holdings[p.tier.name] and source in (None, p.tier.name)]
        if not holders:
            continue
        due = due_on(holders[0], step, tiers, holdings)
        if due:
            found.append(PendingFlush(step, holders[0].tier, tuple(due)))
    return found


def mark_pending(entries: list[dict[str, Any]], tiers: Sequence[TierPolicies]) -> list[dict[str, Any]]:
    """``tierstate ls`` entries, each copy a pending flush would start from given ``due_on``: the tiers
    due to receive it that have not (a crashed run's flushes, or flushes still running)."""
    due = {(p.source.name, p.step): list(p.targets) for p in pending_flushes(tiers)}
    for entry in entries:
        targets = due.get((entry["tier"], entry["step"]))
        if targets:
            entry["due_on"] = targets
    return entries


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


def flush_by_hand(
    tiers: Sequence[TierPolicies],
    source: str | None = None,
    pacer: Pacer | None = None,
    each: Callable[[FlushOutcome], None] | None = None,
) -> FlushRun:
    """What a restarted runner does in the background, in the foreground: every pending flush, oldest
    first (each target as its own outcome, passed to ``each`` as it ends), then retention on every tier.

    Holds the writer lock of each source tier meanwhile: InUseError (naming the host and pid) if a
    runner writes it, since that runner resumes these flushes itself. Leftover partial directories on
    a source tier are removed then (nobody writes them while its writer lock is held here).
    """
    run = FlushRun()
    pending = pending_flushes(tiers, source)
    by_name = {p.tier.name: p.tier for p in tiers}
    sources = {p.source.name: p.source for p in pending}
    claims = []
    try:
        for tier in sources.values():
            claims.append(claim_tier(tier.root, tier.owner))
            collect_garbage([tier], older_than=0)
        for item in pending:
            for name in item.targets:
                outcome = FlushOutcome(item.step, item.source.name, name)
                try:
                    outcome.report = migrate(item.step, item.source, by_name[name], pacer=pacer)
                except Exception as exc:  # reported per step; the other steps are still flushed
                    outcome.error = f"{type(exc).__name__}: {exc}"
                    outcome.damaged = give_up_if_damaged(item.source, item.step, name, exc)
                run.outcomes.append(outcome)
                if each is not None:
                    each(outcome)
        run.pruned = prune(tiers)
    finally:
        for claim in claims:
            claim.release()
    return run
