"""Per-tier policies read from the pipeline YAML: which checkpoints a tier keeps, which it receives and from
where (the flush graph, whose due rule is tiers/ops/due.py).

They live in ``tiers`` (not in the pipeline config) because retention (tiers/ops/retention.py) applies
them and tiers never import pipeline; the pipeline config embeds them under ``tiers.NAME``. The
runner, which flushes and prunes during training, and the ``tierstate`` CLI, which prunes
afterwards, both read them through that one config loader, so they cannot disagree.

Both rules are functions of the step number alone, never of how many checkpoints a run happened to
take, so a restarted run, a second process and the CLI all agree on what a tier is due to hold.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ByteSize, ConfigDict, Field

Positive = Annotated[int, Field(ge=1)]


class _Policy(BaseModel):
    # Typos in a retention block must fail loudly: a silently ignored `keep-last` deletes data.
    # populate_by_name: code builds them by field name (FlushPolicy(source=...)), the YAML by alias.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class RetentionPolicy(_Policy):
    """Which committed checkpoints a tier keeps; with neither rule set the tier keeps everything."""

    keep_last: Positive | None = None
    keep_every: Positive | None = None

    @property
    def active(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None

    def keeps(self, step: int, steps: list[int]) -> str | None:
        """Why ``step`` is kept among the tier's ascending ``steps``, or None when it may go."""
        if not self.active:
            return "no retention policy"
        if self.keep_last is not None and step in steps[-self.keep_last :]:
            return f"keep_last={self.keep_last}"
        if self.keep_every is not None and step % self.keep_every == 0:
            return f"keep_every={self.keep_every}"
        return None

    def describe(self) -> str:
        rules = [
            f"keep_last={self.keep_last}" if self.keep_last else "",
            f"keep_every={self.keep_every}" if self.keep_every else "",
        ]
        return " and ".join(rule for rule in rules if rule) or "keep everything"


class FlushPolicy(_Policy):
    """Background copies into this tier from one faster tier: ``from`` (by default the tier the pipeline
    persists to; tiers/ops/due.py has the rule every flush and retention follow).

    ``every``: the tier receives checkpoints whose step is a multiple of it (1 = all; with a
    checkpoint every N steps, ``every: k*N`` is every k-th checkpoint). ``workers``: checkpoints
    copied to this tier at once. ``bandwidth``: bytes per second shared by those copies, so a flush
    leaves the file system to the job; null = unlimited. ``retries``: more attempts at a copy that
    failed with a transient error (EIO, ENOSPC, a timeout, ...), waiting ``backoff`` seconds before
    the first and twice as long before each next; a copy is resumable, so a retry copies only
    what is missing. A flush that still fails keeps its source copy pinned (retention keeps it).
    """

    # ``from`` in the YAML (a Python keyword): the source tier; None until the config loader names it.
    source: str | None = Field(default=None, alias="from")
    every: Positive = 1
    workers: Positive = 1
    bandwidth: Annotated[ByteSize, Field(gt=0)] | None = None
    retries: Annotated[int, Field(ge=0, le=100)] = 3
    backoff: Annotated[float, Field(gt=0, le=600)] = 1.0

    def due(self, step: int) -> bool:
        return step % self.every == 0


@dataclass(frozen=True)
class FlushEdge:
    """``target`` receives from ``source`` the checkpoints ``policy`` selects."""

    source: str
    target: str
    policy: FlushPolicy


class FlushGraph:
    """The flush edges of one set of tiers; every tier is fed by at most one source."""

    def __init__(self, edges: Iterable[FlushEdge] = ()) -> None:
        self._into = {edge.target: edge for edge in edges}

    @classmethod
    def of(cls, flushes: Iterable[tuple[str, FlushPolicy | None]], default_source: str | None) -> FlushGraph:
        """From each tier's name and flush policy, in tier order; a policy without ``from`` flushes from
        ``default_source`` (the persist tier; a config names every source once loaded)."""
        edges = []
        for name, policy in flushes:
            if policy is None:
                continue
            source = policy.source or default_source
            if source is not None and source != name:
                edges.append(FlushEdge(source, name, policy))
        return cls(edges)

    @property
    def edges(self) -> list[FlushEdge]:
        return list(self._into.values())

    def edges_from(self, source: str) -> list[FlushEdge]:
        """The tiers ``source`` flushes to directly, in tier order."""
        return [edge for edge in self._into.values() if edge.source == source]

    def _path(self, holder: str, target: str) -> list[FlushEdge] | None:
        """The edges from ``holder`` down to ``target``, or None when ``target`` is not downstream of it."""
        path = []
        seen = {target}
        while (edge := self._into.get(target)) is not None:
            path.append(edge)
            if edge.source == holder:
                return path
            target = edge.source
            if target in seen:  # refused by the config checks; a graph built by hand must not loop here
                return None
            seen.add(target)
        return None

    def carries(self, holder: str, target: str, step: int) -> bool:
        """Whether ``step`` on ``holder`` is on its way to ``target``: downstream, every edge selecting it."""
        path = self._path(holder, target)
        return path is not None and all(edge.policy.due(step) for edge in path)

    def reached(self, holder: str, step: int) -> list[str]:
        """Every tier ``step`` goes on to from ``holder``, nearest first (a checkpoint's tier futures)."""
        found, frontier = [], [holder]
        while frontier:
            nxt = [edge.target for name in frontier for edge in self.edges_from(name) if edge.policy.due(step)]
            found += nxt
            frontier = nxt
        return found

    def feeder(self, target: str, step: int, holders: Collection[str]) -> str | None:
        """The holder nearest ``target`` on its way there (the copy a flush to it reads), if any."""
        name, seen = target, {target}
        while (edge := self._into.get(name)) is not None and edge.source not in seen:
            name = edge.source
            if name in holders:
                return name if self.carries(name, target, step) else None
            seen.add(name)
        return None
