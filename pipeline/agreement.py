"""Restore on any number of ranks: every rank restores the same step, each its own part, or all fail alike.

One path for one rank and for many: a process alone is a group of one (pipeline/solo.py), whose
collectives are the identity, so the same rules hold in both (which step, which copy, what is
refused, all or nothing). Every step of the way is agreed on, so that no rank is ever left waiting
in a collective: the ranks exchange which steps their tiers (and buckets) hold and take the newest
one every rank holds (tiers may differ between ranks: a node's own NVMe, a shared PFS); a copy is
used only if every rank read its part of it cleanly (a rank that could not moves on to its next
copy of the step: nearest first, a bucket's last, pipeline/collective_read.py); and the providers
are restored only if every rank's check passed, and kept only if every rank's restore succeeded.

Another copy of the same step is always tried, since it holds the same verified bytes. An older
step is tried only with ``fallback``, because it silently loses training progress otherwise; every
copy skipped and every ``step-N`` passed over that is no checkpoint (it lost its manifest) is logged
and listed in the result's ``problems``. A newest step that lost its manifest is refused as a
corrupt one is: taking the older step would lose the progress in between without a word.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..providers.base import RankLocal, RestoreError
from ..providers.composite import CompositeProvider
from ..tiers.format.gcpause import gc_paused
from ..tiers.storage.filesystem import FilesystemTier, TierError
from ..tiers.storage.s3tier import S3Tier
from .collective_read import CollectiveRead
from .restore import (
    Copy,
    NoCheckpointError,
    NothingToRestoreError,
    RestoreResult,
    candidate_steps,
    checked_target,
    lost_entries,
    unusable,
)
from .solo import RestoreGroup

log = logging.getLogger("tierstate")


@gc_paused()  # the whole restore: listing 10^5 live tensors and planning their reads allocate in bursts too
def restore_checkpoint(
    group: RestoreGroup,
    provider: CompositeProvider,
    tiers: list[FilesystemTier],
    which: int | str,
    allow_pickle: bool,
    fallback: bool = False,
    buckets: Sequence[S3Tier] = (),
) -> RestoreResult:
    """Every rank of ``group`` restores the same step into ``provider``'s children, or every rank fails alike.

    The ranks first tell each other which steps their tiers hold and restore the newest one all
    hold (or ``which``); each rank reads it from its own nearest copy (``tiers`` in order, then
    ``buckets``). A copy a rank cannot read sends that rank to its next copy of the step while the
    others read theirs again. The whole copy is read and verified before any provider is touched.
    """
    holdings = group.all_gather(Holdings.of(tiers, buckets, which, fallback), "restore: which steps each rank holds")
    wanted, candidates, problems = agreed_candidates(holdings)
    reader = CollectiveRead(group, provider, allow_pickle)
    for step in candidates:
        started = time.perf_counter()
        read = reader.read_step(step, holdings[group.rank].copies(step, tiers, buckets), problems)
        if read is None:
            continue
        name, state, served = read
        problems = _texts(holdings, step + 1, wanted) + problems  # steps passed over on the way down
        if problems:
            log.warning("restore: %s; restoring step %d", "; ".join(problems), step)
        if step != wanted:
            log.warning("restore: step %d is unusable, fell back to step %d", wanted, step)
        if reader.path is None:
            log.warning("restore step %d: read from tier %s (%s), no nearer copy was usable", step, name, reader.where)
        restored = CompositeProvider(**{n: c for n, c in provider.children.items() if n not in reader.kept})
        _apply_on_every_rank(group, restored, state, f"restore step {step}")
        derived = _derive_rank_local(group, provider, reader.saved_world)
        kept = tuple(n for n in reader.kept if n not in derived)
        for child in derived:
            log.warning("restore step %d: rank %d has no saved state of %r: its own derived from rank 0's and its "
                        "rank", step, group.rank, child)  # fmt: skip
        for child in kept:
            log.warning("restore step %d: rank %d keeps its own %r: the checkpoint holds no state of this rank's",
                        step, group.rank, child)  # fmt: skip
        seconds = time.perf_counter() - started
        # bytes_read: this rank's reads, not the whole copy's
        return RestoreResult(
            step, name, reader.path, reader.bytes_read, seconds, tuple(problems), served, kept, source=reader.where,
            derived=derived,
        )  # fmt: skip
    problems = _texts(holdings, min(candidates), wanted) + problems
    raise NoCheckpointError(unusable(wanted, fallback, problems))


@dataclass(frozen=True)
class Holdings:
    """What one rank asks to restore and which committed steps each of its tiers holds, sent to every rank."""

    which: int | str
    fallback: bool
    steps: dict[str, list[int]]  # by tier name
    roots: dict[str, str]
    unlisted: dict[str, str]  # the tiers this rank could not list, and why (taken as holding nothing)
    lost: tuple[tuple[int, str], ...] = ()  # step-N entries that are no checkpoint (a lost manifest), and why

    @classmethod
    def of(
        cls, tiers: Sequence[FilesystemTier], buckets: Sequence[S3Tier], which: int | str, fallback: bool
    ) -> Holdings:
        steps, unlisted, lost = {}, {}, []
        roots = {t.name: str(t.root) for t in tiers} | {b.name: b.store.where() for b in buckets}
        for tier in [*tiers, *buckets]:
            try:
                steps[tier.name] = tier.steps()
                lost += lost_entries([tier])
            except OSError as exc:
                steps[tier.name], unlisted[tier.name] = [], f"{type(exc).__name__}: {exc}"
        return cls(which, fallback, steps, roots, unlisted, tuple(lost))

    def copies(self, step: int, tiers: Sequence[FilesystemTier], buckets: Sequence[S3Tier]) -> list[Copy]:
        """This rank's copies of ``step`` as listed here, nearest first: the tiers' directories in their
        order, then the buckets' prefixes (the slowest copy, so the last resort)."""
        local: list[Copy] = [(t.name, t.step_dir(step)) for t in tiers if step in self.steps[t.name]]
        return local + [(b.name, b.source(step)) for b in buckets if step in self.steps[b.name]]

    @property
    def held(self) -> set[int]:
        return {step for steps in self.steps.values() for step in steps}

    def __str__(self) -> str:
        shown = (f"{name}={self.roots[name]} {self.unlisted.get(name, steps)}" for name, steps in self.steps.items())
        return ", ".join(shown)


def agreed_candidates(holdings: list[Holdings]) -> tuple[int, list[int], list[str]]:
    """The step asked for, the steps to try in order, and why newer ones are left out.

    Computed alike on every rank from the same holdings, so every rank goes on or every rank
    raises the same error, naming what each rank holds.
    """
    if len({(h.which, h.fallback) for h in holdings}) > 1:
        each = ", ".join(f"rank {r}: ({h.which!r}, fallback={h.fallback})" for r, h in enumerate(holdings))
        raise ValueError(f"restore: the ranks asked for different checkpoints: {each}")
    which, fallback = holdings[0].which, holdings[0].fallback
    held = [h.held for h in holdings]
    anyone, everyone = set.union(*held), set.intersection(*held)
    if checked_target(which) == "latest":
        if not anyone:
            lost = _texts(holdings, 0, None)
            if lost:  # checkpoints were there and are damaged: not a fresh start
                raise NoCheckpointError(f"no usable checkpoint on {_anywhere(holdings)}: {'; '.join(lost)}")
            raise NothingToRestoreError(f"no committed checkpoint on {_anywhere(holdings)}")
        if not everyone:
            raise NoCheckpointError(
                f"restore latest: no step is committed on a tier of every rank ({_by_rank(holdings)})"
            )
    wanted = candidate_steps(everyone, which, fallback)[0]
    problems = []
    skipped = {s for s in anyone if s > wanted} if which == "latest" else set()  # newer steps some rank lacks
    for step in sorted(skipped | {wanted}):
        lacking = [str(rank) for rank, steps in enumerate(held) if step not in steps]
        if lacking and len(holdings) > 1:
            problems.append(f"step {step} is not on every rank: rank(s) {', '.join(lacking)} lack it")
    if which == "latest":  # a newest step that lost its manifest is refused as a corrupt one is
        newer = _texts(holdings, wanted + 1, None)
        if newer and not fallback:
            raise NoCheckpointError(
                f"cannot restore the latest step: {'; '.join(newer)}; restore(..., fallback=True) takes the newest "
                f"older step ({wanted}) and reports the one(s) passed over"
            )
        problems = newer + problems
    candidates = [step for step in candidate_steps(everyone, wanted, fallback) if step in everyone]
    if not candidates:
        problems = _texts(holdings, wanted, wanted) + problems
        raise NoCheckpointError(f"{unusable(wanted, fallback, problems)} ({_by_rank(holdings)})")
    return wanted, candidates, problems


def _by_rank(holdings: list[Holdings]) -> str:
    """What each rank's tiers hold, for errors; one rank's without a rank number."""
    if len(holdings) == 1:
        return str(holdings[0])
    return "; ".join(f"rank {r}: {h}" for r, h in enumerate(holdings))


def _anywhere(holdings: list[Holdings]) -> str:
    """``any tier (...)``: where a step was looked for, naming each tier (and each rank's, with many)."""
    return f"any tier ({_by_rank(holdings)})" if len(holdings) == 1 else f"any tier of any rank ({_by_rank(holdings)})"


def _texts(holdings: list[Holdings], oldest: int, newest: int | None) -> list[str]:
    """The lost ``step-N`` entries of every rank from ``oldest`` to ``newest`` (None: any), each naming
    its rank when there are several."""
    top = newest if newest is not None else float("inf")
    rank = (lambda r: f"rank {r}: ") if len(holdings) > 1 else (lambda _: "")
    return [f"{rank(r)}{text}" for r, h in enumerate(holdings) for step, text in h.lost if oldest <= step <= top]


def _derive_rank_local(group: RestoreGroup, provider: CompositeProvider, saved_world: int) -> tuple[str, ...]:
    """After a restore on more ranks than saved the checkpoint: the rank-local providers asked to
    (``missing_rank="derive"``) get, on each rank the checkpoint holds nothing of, a state derived from
    rank 0's just restored one and the rank (a collective, run by every rank alike: the condition is the
    same on all). The names of those derived on this rank."""
    local = sorted(n for n, c in provider.children.items() if isinstance(c, RankLocal) and c.missing_rank == "derive")
    if not local or group.world_size <= saved_world:
        return ()
    mine = {n: cast(RankLocal, provider.children[n]).digest() for n in local} if group.rank == 0 else None
    digests = group.all_gather(mine, "restore: rank 0's rank-local state, to derive the others' from")[0]
    if group.rank < saved_world:
        return ()
    for name in local:
        cast(RankLocal, provider.children[name]).derive(digests[name], group.rank)
    return tuple(local)


def _apply_on_every_rank(
    group: RestoreGroup, provider: CompositeProvider, state: Mapping[str, Any], where: str
) -> None:
    """Check, then restore, on every rank in agreed steps: if any rank fails one, every rank is left as it was.

    The providers without ``check`` are restored (and can be put back) before the checked ones, which
    promised to succeed and so are restored only once every rank restored the others.
    """
    restoring = provider.restoring(state)
    _agree(group, f"{where}: checking the state", _attempt(restoring.check))
    for what, step in (
        ("the providers without check", restoring.restore_unchecked),
        ("the others", restoring.restore_checked),
    ):
        problem = _attempt(step)  # a rank that fails here has already put its providers back
        try:
            _agree(group, f"{where}: restoring {what}", problem)
        except RestoreError as exc:
            if problem is None:  # this rank restored, another did not: go back too
                for note in restoring.undo():
                    exc.add_note(note)
            raise


def _attempt(step: Callable[[], None]) -> Exception | None:
    try:
        step()
    except Exception as exc:  # reported on every rank alike by _agree
        return exc
    return None


def _agree(group: RestoreGroup, where: str, problem: BaseException | None) -> None:
    """Go on only if every rank succeeded; otherwise every rank raises a RestoreError naming who failed and why."""
    if problem is not None and group.world_size == 1:
        raise problem  # alone: the error as it was raised, with no other rank's to add
    said = group.all_gather(None if problem is None else f"{type(problem).__name__}: {problem}", where)
    failures = [f"rank {rank}: {text}" for rank, text in enumerate(said) if text is not None]
    if failures:
        raise RestoreError(f"{where}: {'; '.join(failures)}") from problem


def newest_held(group: RestoreGroup, steps: Callable[[], Mapping[str, list[int]]]) -> int | None:
    """The newest step every rank of ``group`` holds on some tier (``steps()``: this rank's tiers' committed
    steps), what ``restore("latest")`` takes; None on a first run. Collective: every rank gets the same
    answer, or the same error if a rank could not list a tier (a step left out for that would be wrong)."""
    held: set[int] = set()
    error = None
    try:
        held = {step for listed in steps().values() for step in listed}
    except OSError as exc:
        error = f"rank {group.rank}: {exc}"
    every = group.all_gather((sorted(held), error), "latest_step: which steps each rank holds")
    held = set.intersection(*(set(listed) for listed, _error in every))
    error = "; ".join(text for _listed, text in every if text is not None) or None
    if error is not None:
        raise TierError(errno.EIO, f"latest_step: a tier could not be listed: {error}")
    return max(held, default=None)
