"""The ``tierstate`` commands that move, check and delete checkpoints: migrate, verify, prune, gc, export.

Each prints plain lines, one per checkpoint (``--json``: one JSON document for scripts), draws a
progress bar with bytes and GB/s on stderr when it is a terminal, for work that moves data, and exits
0 when everything asked for was done, 1 when some checkpoint failed (each failure named), 2 on
bad input.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from .convert import FORMATS
from .export import EXPORT_FORMATS, export
from .format import ManifestError
from .locks import InUseError, reading
from .migrate import MigrateError, MigrateReport, migrate
from .pacing import Pacer
from .policy import RetentionPolicy
from .progress import byte_progress
from .reader import CorruptCheckpointError
from .retention import TierPolicies, collect_garbage, prune
from .tierspec import UsageError, load_tiers, parse_duration, parse_size, pick, select
from .verify import verify_step

# What a single checkpoint's work may fail with: reported for that checkpoint, the others go on.
FAILURES = (MigrateError, CorruptCheckpointError, ManifestError, OSError)


def _tiers(args: argparse.Namespace) -> list[TierPolicies]:
    return load_tiers(args.config, args.tier)


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number")
    return int(text)


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _emit(args: argparse.Namespace, documents: list[dict[str, Any]], lines: list[str]) -> None:
    """Results on stdout: JSON for scripts, else plain unwrapped lines (readable and grep-able)."""
    print(json.dumps(documents, indent=1) if args.json else "\n".join(lines))


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


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


def cmd_migrate(args: argparse.Namespace, console: Console) -> int:
    tiers = _tiers(args)
    source = pick(tiers, args.source, "--from").tier
    target = pick(tiers, args.target, "--to").tier
    if source.name == target.name:
        raise UsageError(f"--from and --to are both {source.name}")
    if (args.step is None) == (not args.all):
        raise UsageError("give either a STEP or --all")
    available = source.steps()
    steps = available if args.all else [args.step]
    if not args.all and args.step not in available:
        raise UsageError(f"--from {source.name}: no committed checkpoint step {args.step} (in {source.root})")
    pacer = Pacer(parse_size(args.bandwidth, "--bandwidth")) if args.bandwidth else None
    documents, lines, failed = [], [], 0
    for step in steps:
        try:
            total = source.manifest(step).stored_bytes
            with byte_progress(not args.json, f"step {step}", total) as advance:
                report = migrate(step, source, target, move=args.move, fmt=args.format, pacer=pacer, progress=advance)
        except (*FAILURES, InUseError) as exc:
            failed += 1
            documents.append({"step": step, "source": source.name, "target": target.name, "error": str(exc)})
            lines.append(f"step {step}: {source.name} -> {target.name}: FAILED: {exc}")
            continue
        documents.append(report.as_dict())
        lines.append(_migrate_line(report))
    _emit(args, documents, lines or [f"{source.name}: no committed checkpoints"])
    return 1 if failed else 0


# --- verify -------------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    chosen = select(_tiers(args), args.only, "--only")
    work = [(p.tier, step) for p in chosen for step in p.tier.steps() if not args.steps or step in args.steps]
    missing = sorted(set(args.steps) - {step for _, step in work})
    if missing:
        raise UsageError(f"step {missing[0]}: no committed checkpoint on {', '.join(p.tier.name for p in chosen)}")
    documents, lines, failed = [], [], 0
    for tier, step in work:
        try:
            total = tier.manifest(step).stored_bytes
        except ManifestError:
            total = 0  # verify_step reports the broken manifest
        try:
            with byte_progress(not args.json, f"{tier.name} step {step}", total) as advance:
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
    _emit(args, documents, lines or ["no committed checkpoints"])
    return 1 if failed else 0


# --- prune and gc -------------------------------------------------------------------------------
def cmd_prune(args: argparse.Namespace, console: Console) -> int:
    tiers = _tiers(args)
    if args.keep_last is not None or args.keep_every is not None:
        policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
        chosen = {p.tier.name for p in select(tiers, args.only, "--only")}
        tiers = [TierPolicies(p.tier, policy, p.flush) if p.tier.name in chosen else p for p in tiers]
    only = {p.tier.name for p in select(tiers, args.only, "--only")}
    if not any(p.retention.active for p in tiers if p.tier.name in only):
        raise UsageError("no retention policy: set tiers.NAME.retention in --config, or give --keep-last/--keep-every")
    decisions = prune(tiers, dry_run=args.dry_run, only=only)
    verb = "would delete" if args.dry_run else "deleted"
    lines = [f"{d.tier} step {d.step}: {verb if d.delete else 'kept'} ({d.reason})" for d in decisions]
    _emit(args, [d.as_dict() for d in decisions], lines or ["nothing to prune"])
    return 0


def cmd_gc(args: argparse.Namespace, console: Console) -> int:
    chosen = [p.tier for p in select(_tiers(args), args.only, "--only")]
    found = collect_garbage(chosen, parse_duration(args.older_than, "--older-than"), dry_run=args.dry_run)
    lines = [f"{f.tier} {f.path.name}: {f.reason} ({f.kind}, {f.age_s:.0f} s old)" for f in found]
    _emit(args, [f.as_dict() for f in found], lines or ["no leftovers"])
    return 0


# --- export -------------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace, console: Console) -> int:
    tiers = [pick(_tiers(args), args.source, "--from")] if args.source else _tiers(args)
    holders = [p.tier for p in tiers if args.step in p.tier.steps()]
    if not holders:
        raise UsageError(f"step {args.step}: no committed checkpoint on {', '.join(p.tier.name for p in tiers)}")
    problems = []
    for tier in holders:  # fastest first; a damaged copy gives way to the next tier's
        try:
            with reading(tier.step_dir(args.step)):
                manifest = tier.manifest(args.step)
                with byte_progress(not args.json, f"export step {args.step}", manifest.raw_bytes) as advance:
                    report = export(tier.step_dir(args.step), manifest, Path(args.out), args.format, advance)
        except FAILURES as exc:
            problems.append(f"{tier.name}: {exc}")
            continue
        line = f"step {args.step} ({tier.name}): {report.items} items, {_size(report.bytes)} -> {report.path}"
        _emit(args, [{**report.as_dict(), "tier": tier.name}], [line])
        return 0
    _emit(args, [{"step": args.step, "error": "; ".join(problems)}], [f"export failed: {'; '.join(problems)}"])
    return 1


# --- wiring -------------------------------------------------------------------------------------
def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register the commands on the ``tierstate`` subparsers; ``common`` has --config/--tier/--json."""

    def command(name: str, fn: Callable[[argparse.Namespace, Console], int], text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, parents=[common], help=text, description=text)
        parser.set_defaults(fn=fn)
        return parser

    def only(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--only", action="append", metavar="TIER", help="work on this tier only (repeatable)")

    m = command("migrate", cmd_migrate, "copy (or --move) committed checkpoints to another tier, verified")
    m.add_argument("step", nargs="?", type=_step, help="the step to migrate (or --all)")
    m.add_argument("--all", action="store_true", help="every committed step of the --from tier")
    m.add_argument("--from", dest="source", required=True, metavar="TIER", help="tier to copy from")
    m.add_argument("--to", dest="target", required=True, metavar="TIER", help="tier to copy to")
    m.add_argument("--move", action="store_true", help="delete the source copy once the target's is published")
    m.add_argument("--format", choices=FORMATS, help="rewrite in this container format (default: keep it)")
    m.add_argument("--bandwidth", metavar="SIZE", help="bytes per second to use at most, e.g. 200MB")

    v = command("verify", cmd_verify, "recompute every checksum; exit 1 naming file and frame of any mismatch")
    v.add_argument("steps", nargs="*", type=_step, metavar="STEP", help="steps to verify (default: all)")
    only(v)

    p = command("prune", cmd_prune, "delete the checkpoints retention does not keep")
    p.add_argument("--keep-last", type=_at_least_one, metavar="N", help="keep the N newest steps (overrides the YAML)")
    p.add_argument("--keep-every", type=_at_least_one, metavar="K", help="keep steps that are multiples of K")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    only(p)

    g = command("gc", cmd_gc, "remove .partial leftovers older than a bound, and .deleting ones")
    g.add_argument("--older-than", default="1h", metavar="AGE", help="e.g. 30m, 2h, 1d (default 1h)")
    g.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    only(g)

    e = command("export", cmd_export, "write one checkpoint as a single HDF5 or safetensors file")
    e.add_argument("step", type=_step, help="the step to export")
    e.add_argument("out", help="the file to write")
    e.add_argument("--format", choices=EXPORT_FORMATS, required=True, help="hdf5 or safetensors")
    e.add_argument("--from", dest="source", metavar="TIER", help="read this tier's copy (default: fastest good one)")
