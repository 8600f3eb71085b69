"""The ``tierstate`` commands: ls, inspect, migrate, verify, prune, gc and export.

They take tier objects and policies, never options or YAML: the command line (pipeline/cli.py)
reads ``--config`` and ``--tier`` the way the runner reads its config and hands the tiers over.
Each prints its results on stdout: rich tables (ls, inspect) or plain lines, one per checkpoint,
or with ``as_json`` one JSON document for scripts; work that moves data draws a progress bar with
bytes and GB/s on stderr when it is a terminal. Each returns the exit code: 0 when everything
asked for was done, 1 when some checkpoint failed (each failure named). Bad requests raise
:class:`UsageError` (exit code 2).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tierstate.errors import TierstateError

from .catalog import copy_state, item_rows, leftover_entries, state_text, summary
from .convert import Format
from .export import ExportFormat, export
from .filesystem import FilesystemTier
from .format import ManifestError, read_manifest
from .locks import InUseError, reading
from .migrate import MigrateReport, migrate
from .pacing import Pacer
from .progress import byte_progress
from .retention import TierPolicies, collect_garbage, prune
from .verify import verify_step

# What a single checkpoint's work may fail with: reported for that checkpoint, the others go on.
FAILURES = (TierstateError, OSError)


class UsageError(TierstateError):
    """A request the tiers cannot serve as asked (no such tier or step, options that contradict):
    printed without a traceback, exit code 2."""


def _emit(as_json: bool, documents: list[dict[str, Any]], lines: list[str]) -> None:
    """Results on stdout: JSON for scripts, else plain unwrapped lines (readable and grep-able)."""
    print(json.dumps(documents, indent=1) if as_json else "\n".join(lines))


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


# --- ls and inspect -----------------------------------------------------------------------------
def list_checkpoints(tiers: Sequence[FilesystemTier], as_json: bool) -> int:
    """Every checkpoint and leftover on ``tiers`` (fastest first), with its state."""
    entries = []
    for tier in tiers:
        for step in tier.steps():
            try:
                entry = {"tier": tier.name, **copy_state(tiers, tier, step), **summary(tier.manifest(step))}
            except ManifestError as exc:
                entry = {"tier": tier.name, "step": step, "state": "invalid", "error": str(exc)}
            entries.append(entry)
        entries += leftover_entries(tier)
    if as_json:
        print(json.dumps(entries, indent=1))
        return 0
    table = Table(title="checkpoints")
    for column in ("tier", "step", "state", "items", "stored bytes", "created"):
        table.add_column(column)
    for e in entries:
        stored = f"{e['stored_bytes']:,}" if "stored_bytes" in e else ""
        created = e.get("created", "")
        table.add_row(e["tier"], str(e["step"]), state_text(e), str(e.get("items", "")), stored, created)
    Console().print(table)
    return 0


def step_dir(tiers: Sequence[FilesystemTier], step: int) -> Path:
    """The directory of ``step`` on the fastest tier that holds it committed."""
    for tier in tiers:
        if step in tier.steps():
            return tier.step_dir(step)
    raise UsageError(f"step {step}: no committed checkpoint on any tier")


def inspect_checkpoint(directory: Path, as_json: bool) -> int:
    """The manifest of the checkpoint in ``directory`` as a table of its items."""
    manifest = read_manifest(directory)
    rows = item_rows(manifest)
    if as_json:
        print(json.dumps({**summary(manifest), "item_table": rows}, indent=1))
        return 0
    table = Table(title=f"step {manifest.step}: {len(rows)} items, {manifest.raw_bytes:,} bytes")
    for column in ("key", "kind", "type", "shape", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for row in rows:
        table.add_row(row["key"], row["kind"], row["type"], row["shape"], f"{row['bytes']:,}")
    Console().print(table)
    return 0


# --- migrate ------------------------------------------------------------------------------------
def _migrate_line(report: MigrateReport) -> str:
    head = f"step {report.step}: {report.source} -> {report.target}: "
    if report.outcome == "already there":
        body = "already there"
    else:
        moved = report.bytes_copied + report.bytes_reused
        body = f"{report.outcome} {report.frames_copied} of {report.frames} frames"
        if report.frames_reused:
            body += f" (resumed: {report.frames_reused} already there and verified)"
        body += f", {_size(moved)} in {report.seconds:.2f} s ({report.gbps:.2f} GB/s), verified, published"
    return head + body + (", source deleted" if report.moved else "")


def migrate_steps(
    source: FilesystemTier,
    target: FilesystemTier,
    step: int | None,
    *,
    move: bool = False,
    fmt: Format | None = None,
    bandwidth: int | None = None,
    as_json: bool = False,
) -> int:
    """Copy (``move``: then delete from ``source``) checkpoint ``step``, or every committed one
    when ``step`` is None, at most ``bandwidth`` bytes/s; each failure is named, the others go on."""
    available = source.steps()
    if step is not None and step not in available:
        raise UsageError(f"--from {source.name}: no committed checkpoint step {step} (in {source.root})")
    pacer = Pacer(bandwidth) if bandwidth else None
    documents, lines, failed = [], [], 0
    for each in available if step is None else [step]:
        try:
            total = source.manifest(each).stored_bytes
            with byte_progress(not as_json, f"step {each}", total) as advance:
                report = migrate(each, source, target, move=move, fmt=fmt, pacer=pacer, progress=advance)
        except (*FAILURES, InUseError) as exc:
            failed += 1
            documents.append({"step": each, "source": source.name, "target": target.name, "error": str(exc)})
            lines.append(f"step {each}: {source.name} -> {target.name}: FAILED: {exc}")
            continue
        documents.append(report.as_dict())
        lines.append(_migrate_line(report))
    _emit(as_json, documents, lines or [f"{source.name}: no committed checkpoints"])
    return 1 if failed else 0


# --- verify -------------------------------------------------------------------------------------
def verify_steps(tiers: Sequence[FilesystemTier], steps: Collection[int], as_json: bool = False) -> int:
    """Recompute every checksum of ``steps`` (all when empty) on each of ``tiers``."""
    work = [(tier, step) for tier in tiers for step in tier.steps() if not steps or step in steps]
    missing = sorted(set(steps) - {step for _, step in work})
    if missing:
        raise UsageError(f"step {missing[0]}: no committed checkpoint on {', '.join(t.name for t in tiers)}")
    documents, lines, failed = [], [], 0
    for tier, step in work:
        try:
            total = tier.manifest(step).stored_bytes
        except ManifestError:
            total = 0  # verify_step reports the broken manifest
        try:
            with byte_progress(not as_json, f"{tier.name} step {step}", total) as advance:
                result = verify_step(tier, step, advance)
        except FileNotFoundError as exc:  # deleted by retention between listing and locking
            lines.append(f"{tier.name} step {step}: skipped: {exc}")
            continue
        documents.append(result.as_dict())
        if result.ok:
            rate = result.bytes / result.seconds / 1e9 if result.seconds else 0.0
            lines.append(f"{tier.name} step {step}: ok ({_size(result.bytes)}, {rate:.2f} GB/s)")
        else:
            failed += 1
            lines.append(f"{tier.name} step {step}: FAILED")
            lines += [f"  {problem}" for problem in result.problems]
        lines += [f"  warning: {warning}" for warning in result.warnings]
    _emit(as_json, documents, lines or ["no committed checkpoints"])
    return 1 if failed else 0


# --- prune and gc -------------------------------------------------------------------------------
def prune_tiers(
    tiers: Sequence[TierPolicies], only: Collection[str], dry_run: bool = False, as_json: bool = False
) -> int:
    """Apply the retention policies of the tiers named in ``only``; every tier's flush policy and
    holdings decide what is still due somewhere."""
    if not any(p.retention.active for p in tiers if p.tier.name in only):
        raise UsageError("no retention policy: set tiers.NAME.retention in --config, or give --keep-last/--keep-every")
    decisions = prune(tiers, dry_run=dry_run, only=only)
    verb = "would delete" if dry_run else "deleted"
    lines = [f"{d.tier} step {d.step}: {verb if d.delete else 'kept'} ({d.reason})" for d in decisions]
    _emit(as_json, [d.as_dict() for d in decisions], lines or ["nothing to prune"])
    return 0


def collect_leftovers(
    tiers: Sequence[FilesystemTier], older_than: float, dry_run: bool = False, as_json: bool = False
) -> int:
    """Remove ``.deleting`` directories and ``.partial`` ones untouched for ``older_than`` seconds."""
    found = collect_garbage(tiers, older_than, dry_run=dry_run)
    lines = [f"{f.tier} {f.path.name}: {f.reason} ({f.kind}, {f.age_s:.0f} s old)" for f in found]
    _emit(as_json, [f.as_dict() for f in found], lines or ["no leftovers"])
    return 0


# --- export -------------------------------------------------------------------------------------
def export_step(
    tiers: Sequence[FilesystemTier], step: int, out: Path, fmt: ExportFormat, as_json: bool = False
) -> int:
    """Write checkpoint ``step`` to the single file ``out``, from the fastest of ``tiers`` whose copy is good."""
    holders = [tier for tier in tiers if step in tier.steps()]
    if not holders:
        raise UsageError(f"step {step}: no committed checkpoint on {', '.join(t.name for t in tiers)}")
    problems = []
    for tier in holders:  # fastest first; a damaged copy gives way to the next tier's
        try:
            with reading(tier.step_dir(step)):
                manifest = tier.manifest(step)
                with byte_progress(not as_json, f"export step {step}", manifest.raw_bytes) as advance:
                    report = export(tier.step_dir(step), manifest, out, fmt, advance)
        except FAILURES as exc:
            problems.append(f"{tier.name}: {exc}")
            continue
        line = f"step {step} ({tier.name}): {report.items} items, {_size(report.bytes)} -> {report.path}"
        _emit(as_json, [{**report.as_dict(), "tier": tier.name}], [line])
        return 0
    _emit(as_json, [{"step": step, "error": "; ".join(problems)}], [f"export failed: {'; '.join(problems)}"])
    return 1
