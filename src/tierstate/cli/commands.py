"""What the ``tierstate`` commands do: ls, inspect, migrate, verify, prune and export.

They take tier objects and policies, never options or YAML, and return data, never print: the
command line (tierstate/cli/) reads ``--config`` and ``--tier`` the way the runner reads its config,
hands the tiers over, and renders what comes back as lines, tables or JSON. Work that moves data
reports its bytes through a ``progress`` the caller gives (the CLI draws a bar on a terminal). A
checkpoint that fails is returned as a failure next to the others' results, which go on; a request
the tiers cannot serve as asked raises :class:`UsageError`. A bucket tier (:class:`~tiers.storage.s3tier.S3Tier`)
is taken wherever a directory tier is, its work done by :mod:`cli.buckets` and its copies read
through the same :class:`~tiers.reading.stored.StoredCheckpoint`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tierstate.errors import TierstateError, UsageError

from ..tiers.format.convert import Format
from ..tiers.format.format import ManifestError
from ..tiers.ops.catalog import copy_state, invalid_entries, item_rows, leftover_entries, summary
from ..tiers.ops.export import ExportFormat, ExportReport, export
from ..tiers.ops.hfdir import MAX_SHARD_SIZE, export_hf, weight_files
from ..tiers.ops.migrate import MigrateReport
from ..tiers.ops.pacing import Pacer
from ..tiers.ops.retention import BucketPolicies, Decision, TierPolicies, graph_of, prune, prune_bucket
from ..tiers.ops.transfer import transfer
from ..tiers.ops.verify import VerifyResult, invalid_result, verify_step
from ..tiers.reading.stored import Location, StoredCheckpoint, read_first_clean
from ..tiers.storage.filesystem import FilesystemTier, InvalidEntry
from ..tiers.storage.locks import InUseError
from ..tiers.storage.peers import peer_copies
from ..tiers.storage.slotdirs import pool_holdings
from ..tiers.storage.tier import Tier

Writer = Callable[[StoredCheckpoint, Path, Callable[[int], None] | None], ExportReport]
"""Writes one checkpoint to ``out`` in some format, reporting bytes as it goes."""

# What a single checkpoint's work may fail with: reported for that checkpoint, the others go on.
FAILURES = (TierstateError, OSError)
HF_NEEDS_PROVIDER = "--format hf writes one model's weights: give --provider NAME (e.g. --provider model)"


Advance = Callable[[int], None]
Progress = Callable[[str, int], AbstractContextManager[Advance]]
"""``progress(description, total_bytes)``: a context whose value is called with the bytes done."""


@contextmanager
def no_progress(_description: str, _total: int) -> Iterator[Advance]:
    """The progress of a caller that shows none."""
    yield lambda _nbytes: None


# --- ls and inspect -----------------------------------------------------------------------------
def list_checkpoints(tiers: Sequence[FilesystemTier]) -> list[dict[str, Any]]:
    """Every checkpoint and leftover on ``tiers`` (fastest first), with its state; after each tier, the peer
    copies its directory holds (another node's part, or this node's sent back), as tiers of their own."""
    entries = []
    for tier in tiers:
        entries += _tier_entries(tiers, tier)
        for copies in peer_copies(tier):
            entries += _tier_entries([copies], copies)  # another node's part: flushed nowhere from here
    return entries


def _tier_entries(chain: Sequence[FilesystemTier], tier: FilesystemTier) -> list[dict[str, Any]]:
    """``tier``'s checkpoints (flushed: also on a later tier of ``chain``), invalid entries and leftovers."""
    entries = []
    for step in tier.steps():
        try:
            entry = {"tier": tier.name, **copy_state(chain, tier, step), **summary(tier.manifest(step))}
        except ManifestError as exc:
            entry = {"tier": tier.name, "step": step, "state": "invalid", "error": str(exc)}
        entries.append(entry)
    return entries + invalid_entries(tier) + leftover_entries(tier)


def node_state(tiers: Sequence[FilesystemTier]) -> list[dict[str, Any]]:
    """What lives beside the checkpoints of ``tiers`` on this node: a node agent and the trainers attached to it
    (pipeline/agent.py), and each rank's slot pool of a memory tier (tiers/storage/slotdirs.py)."""
    from ..pipeline.agent import agent_status  # the agent's module loads the runner's config machinery

    found: list[dict[str, Any]] = []
    for tier in tiers:
        status = agent_status(tier.root)
        if status is not None:
            found.append({"tier": tier.name, "agent": status})
        for rank, (files, held) in pool_holdings(tier.root).items():
            found.append({"tier": tier.name, "rank": rank, "free_files": files, "allocated_bytes": held})
    return found


def step_location(tiers: Sequence[Tier], step: int) -> Location:
    """Where ``step`` is on the fastest tier that holds it committed: a directory, or a bucket's prefix."""
    for tier in tiers:
        if step in tier.steps():
            return tier.location(step)
    raise UsageError(f"step {step}: no committed checkpoint on any tier")


def inspect_checkpoint(location: Location) -> dict[str, Any]:
    """The manifest of the checkpoint at ``location``: its summary and ``item_table``, a row per item."""
    manifest = StoredCheckpoint(location).manifest
    return {**summary(manifest), "item_table": item_rows(manifest)}


# --- migrate ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MigrateFailure:
    """A step that did not migrate, and why; the other steps went on."""

    step: int
    source: str
    target: str
    error: str

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "source": self.source, "target": self.target, "error": self.error}


def migrate_steps(
    source: Tier,
    target: Tier,
    step: int | None,
    *,
    move: bool = False,
    fmt: Format | None = None,
    bandwidth: int | None = None,
    progress: Progress = no_progress,
    each: Callable[[MigrateReport | MigrateFailure], None] | None = None,
) -> list[MigrateReport | MigrateFailure]:
    """Copy (``move``: then delete from ``source``) checkpoint ``step``, or every committed one
    when ``step`` is None, at most ``bandwidth`` bytes/s; each failure is named, the others go on.
    Between a directory tier and a bucket (either way) the checkpoint moves as it is (no ``fmt``).
    Each step's result is also passed to ``each`` as it ends, so an interrupted run has said what it did."""
    available = source.steps()
    if step is not None and step not in available:
        raise UsageError(f"--from {source.name}: no committed checkpoint step {step} (in {source.where()})")
    bucket = source.as_directory() is None or target.as_directory() is None
    if bucket and fmt is not None:
        raise UsageError("--format: a bucket takes and gives checkpoints as they are; convert on a directory tier")
    pacer = Pacer(bandwidth) if bandwidth else None
    results: list[MigrateReport | MigrateFailure] = []
    for number in available if step is None else [step]:
        try:
            total = source.manifest(number).stored_bytes
            with progress(f"step {number}", total) as advance:
                report = transfer(number, source, target, move=move, fmt=fmt, pacer=pacer, progress=advance)
            result: MigrateReport | MigrateFailure = report
        except (*FAILURES, InUseError) as exc:
            result = MigrateFailure(number, source.name, target.name, str(exc))
        results.append(result)
        if each is not None:
            each(result)
    return results


# --- verify -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifySkipped:
    """A step deleted (by retention) between listing and verifying it: nothing to verify."""

    tier: str
    step: int
    reason: str


def verify_steps(
    tiers: Sequence[Tier], steps: Collection[int], progress: Progress = no_progress
) -> list[VerifyResult | VerifySkipped]:
    """Recompute every checksum of ``steps`` (all when empty) on each of ``tiers`` and the peer copies each holds."""
    # Each tier's committed steps, and its step-N entries that are not checkpoints (a lost manifest,
    # a symlink): those fail, named, without anything in them being read.
    work: list[tuple[Tier, int, InvalidEntry | None]] = []
    for tier in [each for given in tiers for each in (given, *_peer_copies(given))]:
        listed: list[tuple[int, InvalidEntry | None]] = [(step, None) for step in tier.steps()]
        listed += [(entry.step, entry) for entry in tier.invalid() if entry.named_as_checkpoint]
        listed.sort(key=lambda step_entry: step_entry[0])
        work += [(tier, step, entry) for step, entry in listed if not steps or step in steps]
    missing = sorted(set(steps) - {step for _, step, _ in work})
    if missing:
        raise UsageError(f"step {missing[0]}: no committed checkpoint on {', '.join(t.name for t in tiers)}")
    results: list[VerifyResult | VerifySkipped] = []
    for tier, step, invalid in work:
        if invalid is not None:
            results.append(invalid_result(tier, invalid))
            continue
        try:
            total = tier.manifest(step).stored_bytes
        except ManifestError:
            total = 0  # verify_step reports the broken manifest
        try:
            with progress(f"{tier.name} step {step}", total) as advance:
                results.append(verify_step(tier, step, advance))
        except FileNotFoundError as exc:  # deleted by retention between listing and locking
            results.append(VerifySkipped(tier.name, step, str(exc)))
    return results


def _peer_copies(tier: Tier) -> list[FilesystemTier]:
    directory = tier.as_directory()
    return [] if directory is None else peer_copies(directory)


# --- prune and gc -------------------------------------------------------------------------------
def _disk_bytes(directory: Path) -> int:
    """The space the files of ``directory`` take on disk (holes left by frame alignment excluded), as du counts."""
    try:
        entries = os.scandir(directory)  # sizes of the regular files themselves, never what a symlink names
        return sum(e.stat(follow_symlinks=False).st_blocks * 512 for e in entries if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return 0


@dataclass(frozen=True)
class Pruning:
    """What pruning did (or, ``dry_run``, would do): a decision per step, each step's size on disk;
    ``declined``: the plan was shown and the answer was no, so nothing was deleted."""

    decisions: list[Decision]
    sizes: dict[tuple[str, int], int] = field(default_factory=dict)
    dry_run: bool = False
    declined: bool = False

    @property
    def doomed(self) -> list[Decision]:
        return [d for d in self.decisions if d.delete]

    def size(self, decision: Decision) -> int:
        return self.sizes.get((decision.tier, decision.step), 0)

    @property
    def freed(self) -> int:
        return sum(self.size(d) for d in self.doomed)


def prune_tiers(
    tiers: Sequence[TierPolicies],
    only: Collection[str],
    dry_run: bool = False,
    confirm: Callable[[Pruning], bool] | None = None,
    buckets: Sequence[BucketPolicies] = (),
) -> Pruning:
    """Apply the retention policies of the tiers named in ``only``; every tier's flush policy and
    holdings decide what is still due somewhere. ``confirm``: given the plan (what would be deleted
    and freed) before anything is deleted, and asked whether to go on; None = do not ask. A bucket's
    retention is applied on its own steps (``buckets``, those named in ``only``)."""
    graph = graph_of(tiers, [(b.tier.name, b.flush) for b in buckets])  # a bucket's flush keeps its source
    buckets = [b for b in buckets if b.tier.name in only and b.retention.active]
    if not buckets and not any(p.retention.active for p in tiers if p.tier.name in only):
        raise UsageError("no retention policy: set tiers.NAME.retention in --config, or give --keep-last/--keep-every")
    sizes = {(p.tier.name, step): _disk_bytes(p.tier.step_dir(step))
             for p in tiers if p.tier.name in only for step in p.tier.steps()}  # fmt: skip

    def apply(dry_run: bool) -> list[Decision]:
        decisions = prune(tiers, dry_run=dry_run, only=only, graph=graph)
        for bucket in buckets:
            decided, held = prune_bucket(bucket, dry_run)
            decisions += decided
            sizes.update(held)
        return decisions

    if confirm is not None and not dry_run:
        plan = Pruning(apply(dry_run=True), sizes, dry_run=True)
        if not plan.doomed:  # nothing to ask about, nor to delete unasked: the plan is the report
            return plan
        if not confirm(plan):
            return Pruning([], sizes, dry_run=True, declined=True)
    return Pruning(apply(dry_run), sizes, dry_run)


# --- export -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exported:
    """Checkpoint ``report.step`` written from ``tier``'s copy."""

    tier: str
    report: ExportReport


@dataclass(frozen=True)
class ExportFailure:
    """No tier's copy of ``step`` could be exported: each tier's problem."""

    step: int
    problems: list[str]


def export_step(
    tiers: Sequence[Tier],
    step: int,
    out: Path,
    fmt: str,
    force: bool = False,
    provider: str | None = None,
    max_shard_size: int = MAX_SHARD_SIZE,
    writer: Writer | None = None,
    progress: Progress = no_progress,
) -> Exported | ExportFailure:
    """Write checkpoint ``step`` (``provider``'s items only, when given) to ``out``, from the fastest of ``tiers``
    whose copy is good: a single file, or for ``hf`` a model directory of ``max_shard_size`` shards. What exists
    there already (the file; an earlier export's weight files) is replaced only with ``force``. ``writer``
    writes formats other than those of tiers/ops/export.py (``export_dcp`` of tierstate.integrations.dcp: a DCP
    directory); ``fmt`` names them."""
    holders = [tier for tier in tiers if step in tier.steps()]
    if not holders:
        raise UsageError(f"step {step}: no committed checkpoint on {', '.join(t.name for t in tiers)}")
    if fmt == "hf" and provider is None:
        raise UsageError(HF_NEEDS_PROVIDER)
    if provider is not None:
        present = StoredCheckpoint(holders[0].location(step), step).providers()
        if provider not in present:
            raise UsageError(f"step {step}: no provider {provider!r} (providers: {', '.join(present) or 'none'})")
    existing = weight_files(out) if fmt == "hf" and not out.is_symlink() else [out]
    if fmt == "hf" and out.exists() and not out.is_dir():
        raise UsageError(f"{out} is not a directory; --format hf writes a model directory")
    if any(path.exists() or path.is_symlink() for path in existing) and not force:
        raise UsageError(f"{existing[0]} exists; give --force to replace it")

    def write(checkpoint: StoredCheckpoint, advance: Callable[[int], None]) -> ExportReport:
        if writer is not None:
            return writer(checkpoint, out, advance)
        if fmt != "hf":
            return export(checkpoint, out, cast(ExportFormat, fmt), advance, provider)
        if provider is None:  # refused above, before anything was read
            raise UsageError(HF_NEEDS_PROVIDER)
        return export_hf(checkpoint, out, provider, advance, max_shard_size)

    def measured(checkpoint: StoredCheckpoint) -> ExportReport:
        with progress(f"export step {step}", checkpoint.stored_bytes) as advance:
            return write(checkpoint, advance)

    problems: list[str] = []
    found = read_first_clean(holders, step, measured, problems, errors=FAILURES, label="{tier}")  # one step
    if found is not None:
        return Exported(found[0].name, found[1])
    return ExportFailure(step, problems)
