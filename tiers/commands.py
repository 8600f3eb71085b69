"""The ``tierstate`` commands: ls, inspect, migrate, verify, prune, gc and export.

They take tier objects and policies, never options or YAML: the command line (pipeline/cli.py)
reads ``--config`` and ``--tier`` the way the runner reads its config and hands the tiers over.
Each prints its results on stdout: plain lines, one per checkpoint (ls and inspect: a table, drawn
with rich on a terminal, plain padded columns otherwise, never cut), or with ``as_json`` one JSON
document for scripts; work that moves data draws a progress bar with bytes and GB/s on stderr when
it is a terminal. Each returns the exit code: 0 when everything asked for was done, 1 when some
checkpoint failed (each failure named). Bad requests raise :class:`UsageError` (exit code 2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, cast

from rich.console import Console
from rich.table import Table

from tierstate.errors import TierstateError

from .catalog import copy_state, invalid_entries, item_rows, leftover_entries, state_text, summary
from .convert import Format
from .export import ExportFormat, ExportReport, export, providers_of
from .filesystem import FilesystemTier, InvalidEntry
from .format import Manifest, ManifestError, read_manifest
from .hfdir import MAX_SHARD_SIZE, export_hf, weight_files
from .locks import InUseError, reading
from .migrate import MigrateReport, migrate
from .pacing import Pacer
from .peers import peer_copies
from .progress import byte_progress
from .retention import Decision, TierPolicies, collect_garbage, prune
from .verify import invalid_result, verify_step

Writer = Callable[[Path, Manifest, Path, Callable[[int], None] | None], ExportReport]
"""Writes one checkpoint (directory, manifest) to ``out`` in some format, reporting bytes as it goes."""

# What a single checkpoint's work may fail with: reported for that checkpoint, the others go on.
FAILURES = (TierstateError, OSError)


class UsageError(TierstateError):
    """A request the tiers cannot serve as asked (no such tier or step, options that contradict):
    printed without a traceback, exit code 2."""


def _emit(as_json: bool, documents: list[dict[str, Any]], lines: list[str]) -> None:
    """Results on stdout: JSON for scripts, else plain unwrapped lines (readable and grep-able)."""
    print(json.dumps(documents, indent=1) if as_json else "\n".join(lines))


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _rate(nbytes: int, seconds: float) -> str:
    """``0.44 GB/s``, or ``12.5 MB/s`` for slow copies (a paced migration, a network file system)."""
    return _size(nbytes / seconds if seconds > 0 else 0) + "/s"


def _table(
    title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[str] = ()
) -> None:
    """A table on stdout. On a terminal, drawn by rich, long cells folded onto more lines, never cut;
    otherwise (a file, a pipe) plain lines in padded columns, each row whole on its line, for grep and awk."""
    console = Console()
    if console.is_terminal:
        table = Table(title=title)
        for column in columns:
            table.add_column(column, justify="right" if column in right else "left", overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    widths = [max(len(cell) for cell in cells) for cells in zip(columns, *rows, strict=True)]
    lines = [title] if title else []
    for row in (columns, *rows):
        cells = (c.rjust(w) if name in right else c.ljust(w) for c, w, name in zip(row, widths, columns, strict=True))
        lines.append("  ".join(cells).rstrip())
    print("\n".join(lines))


# --- ls and inspect -----------------------------------------------------------------------------
def list_checkpoints(tiers: Sequence[FilesystemTier], as_json: bool) -> int:
    """Every checkpoint and leftover on ``tiers`` (fastest first), with its state; after each tier, the peer
    copies its directory holds (another node's part, or this node's sent back), as tiers of their own."""
    entries = []
    for tier in tiers:
        entries += _tier_entries(tiers, tier)
        for copies in peer_copies(tier):
            entries += _tier_entries([copies], copies)  # another node's part: flushed nowhere from here
    if as_json:
        print(json.dumps(entries, indent=1))
        return 0
    if not entries:
        print(f"no checkpoints on {', '.join(t.name for t in tiers)}")
        return 0
    rows = [
        (e["tier"], str(e["step"]), state_text(e), str(e.get("items", "")),
         f"{e['stored_bytes']:,}" if "stored_bytes" in e else "", e.get("created", ""))
        for e in entries
    ]  # fmt: skip
    _table(None, ("tier", "step", "state", "items", "stored bytes", "created"), rows, right={"items", "stored bytes"})
    return 0


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
    title = f"step {manifest.step}: {len(rows)} items, {manifest.raw_bytes:,} bytes"
    cells = [(row["key"], row["kind"], row["type"], row["shape"], f"{row['bytes']:,}") for row in rows]
    _table(title, ("key", "kind", "type", "shape", "bytes"), cells, right={"bytes"})
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
        body += f", {_size(moved)} in {report.seconds:.2f} s ({_rate(moved, report.seconds)}), verified, published"
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
    """Recompute every checksum of ``steps`` (all when empty) on each of ``tiers`` and the peer copies each holds."""
    # Each tier's committed steps, and its step-N entries that are not checkpoints (a lost manifest,
    # a symlink): those fail, named, without anything in them being read.
    work: list[tuple[FilesystemTier, int, InvalidEntry | None]] = []
    for tier in [each for given in tiers for each in (given, *peer_copies(given))]:
        listed: list[tuple[int, InvalidEntry | None]] = [(step, None) for step in tier.steps()]
        listed += [(entry.step, entry) for entry in tier.invalid() if entry.named_as_checkpoint]
        listed.sort(key=lambda step_entry: step_entry[0])
        work += [(tier, step, entry) for step, entry in listed if not steps or step in steps]
    missing = sorted(set(steps) - {step for _, step, _ in work})
    if missing:
        raise UsageError(f"step {missing[0]}: no committed checkpoint on {', '.join(t.name for t in tiers)}")
    documents, lines, failed = [], [], 0
    for tier, step, invalid in work:
        if invalid is not None:
            result = invalid_result(tier, invalid)
        else:
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
            lines.append(f"{tier.name} step {step}: ok ({_size(result.bytes)}, {_rate(result.bytes, result.seconds)})")
        else:
            failed += 1
            lines.append(f"{tier.name} step {step}: FAILED")
            lines += [f"  {problem}" for problem in result.problems]
        lines += [f"  warning: {warning}" for warning in result.warnings]
    _emit(as_json, documents, lines or ["no committed checkpoints"])
    return 1 if failed else 0


# --- prune and gc -------------------------------------------------------------------------------
def _disk_bytes(directory: Path) -> int:
    """The space the files of ``directory`` take on disk (holes left by frame alignment excluded), as du counts."""
    try:
        entries = os.scandir(directory)  # sizes of the regular files themselves, never what a symlink names
        return sum(e.stat(follow_symlinks=False).st_blocks * 512 for e in entries if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return 0


def prune_tiers(
    tiers: Sequence[TierPolicies],
    only: Collection[str],
    dry_run: bool = False,
    as_json: bool = False,
    confirm: Callable[[str], bool] | None = None,
) -> int:
    """Apply the retention policies of the tiers named in ``only``; every tier's flush policy and
    holdings decide what is still due somewhere. Says what each deletion frees. ``confirm``: asked
    (with the question) before anything is deleted, after the plan is shown; None = do not ask."""
    if not any(p.retention.active for p in tiers if p.tier.name in only):
        raise UsageError("no retention policy: set tiers.NAME.retention in --config, or give --keep-last/--keep-every")
    sizes = {(p.tier.name, step): _disk_bytes(p.tier.step_dir(step))
             for p in tiers if p.tier.name in only for step in p.tier.steps()}  # fmt: skip
    if confirm is not None and not dry_run:
        plan = prune(tiers, dry_run=True, only=only)
        doomed = [d for d in plan if d.delete]
        if not doomed:  # nothing to ask about, nor to delete unasked: the plan is the report
            _report_pruning(plan, sizes, dry_run=True, as_json=as_json)
            return 0
        if not as_json:  # one JSON document on stdout, the result's; the question alone says enough
            _report_pruning(plan, sizes, dry_run=True, as_json=False)
        freed = _size(sum(sizes[d.tier, d.step] for d in doomed))
        if not confirm(f"delete {len(doomed)} checkpoint{'s' if len(doomed) > 1 else ''}, freeing {freed}? [y/N] "):
            _emit(as_json, [], ["nothing deleted"])
            return 0
    _report_pruning(prune(tiers, dry_run=dry_run, only=only), sizes, dry_run=dry_run, as_json=as_json)
    return 0


def _report_pruning(
    decisions: Sequence[Decision], sizes: dict[tuple[str, int], int], dry_run: bool, as_json: bool
) -> None:
    """One line per step (what was or would be deleted, and its size), then the space freed."""
    verb = "would delete" if dry_run else "deleted"
    lines = [
        f"{d.tier} step {d.step}: {verb} {_size(sizes.get((d.tier, d.step), 0))} ({d.reason})"
        if d.delete else f"{d.tier} step {d.step}: kept ({d.reason})"
        for d in decisions
    ]  # fmt: skip
    if any(d.delete for d in decisions):
        freed = sum(sizes.get((d.tier, d.step), 0) for d in decisions if d.delete)
        lines.append(f"{'would free' if dry_run else 'freed'} {_size(freed)} in all")
    documents = [{**d.as_dict(), "bytes": sizes.get((d.tier, d.step), 0)} for d in decisions]
    _emit(as_json, documents, lines or ["nothing to prune"])


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
    tiers: Sequence[FilesystemTier],
    step: int,
    out: Path,
    fmt: str,
    as_json: bool = False,
    force: bool = False,
    provider: str | None = None,
    max_shard_size: int = MAX_SHARD_SIZE,
    writer: Writer | None = None,
) -> int:
    """Write checkpoint ``step`` (``provider``'s items only, when given) to ``out``, from the fastest of ``tiers``
    whose copy is good: a single file, or for ``hf`` a model directory of ``max_shard_size`` shards. What exists
    there already (the file; an earlier export's weight files) is replaced only with ``force``. ``writer``
    writes formats other than those of tiers/export.py (``export_dcp`` of tierstate.integrations.dcp: a DCP
    directory); ``fmt`` names them."""
    holders = [tier for tier in tiers if step in tier.steps()]
    if not holders:
        raise UsageError(f"step {step}: no committed checkpoint on {', '.join(t.name for t in tiers)}")
    if fmt == "hf" and provider is None:
        raise UsageError("--format hf writes one model's weights: give --provider NAME (e.g. --provider model)")
    if provider is not None:
        manifest = holders[0].manifest(step)
        if not any(key.startswith(f"{provider}/") for key in manifest.items):
            present = providers_of(manifest)
            raise UsageError(f"step {step}: no provider {provider!r} (providers: {', '.join(present) or 'none'})")
    existing = weight_files(out) if fmt == "hf" and not out.is_symlink() else [out]
    if fmt == "hf" and out.exists() and not out.is_dir():
        raise UsageError(f"{out} is not a directory; --format hf writes a model directory")
    if any(path.exists() or path.is_symlink() for path in existing) and not force:
        raise UsageError(f"{existing[0]} exists; give --force to replace it")

    def write(directory: Path, manifest: Manifest, advance: Callable[[int], None]) -> ExportReport:
        if writer is not None:
            return writer(directory, manifest, out, advance)
        if fmt == "hf":
            assert provider is not None
            return export_hf(directory, manifest, out, provider, advance, max_shard_size)
        return export(directory, manifest, out, cast(ExportFormat, fmt), advance, provider)

    problems = []
    for tier in holders:  # fastest first; a damaged copy gives way to the next tier's
        try:
            with reading(tier.step_dir(step)):
                manifest = tier.manifest(step)
                with byte_progress(not as_json, f"export step {step}", manifest.raw_bytes) as advance:
                    report = write(tier.step_dir(step), manifest, advance)
        except FAILURES as exc:
            problems.append(f"{tier.name}: {exc}")
            continue
        line = f"step {step} ({tier.name}): {report.items} items, {_size(report.bytes)} -> {report.path}"
        _emit(as_json, [{**report.as_dict(), "tier": tier.name}], [line])
        return 0
    _emit(as_json, [{"step": step, "error": "; ".join(problems)}], [f"export failed: {'; '.join(problems)}"])
    return 1
