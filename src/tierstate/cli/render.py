"""How the results of the ``tierstate`` commands look: plain lines, tables, or one JSON document.

Results go to stdout: with ``--json`` one JSON document for scripts; else plain lines, one per
checkpoint, never cut (ls and inspect: a table, drawn with rich on a terminal, padded columns
otherwise, for grep and awk). Each function that renders a command's results returns the exit
code they mean: 0 when everything asked for was done, 1 when some checkpoint failed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..tiers.commands import Exported, ExportFailure, MigrateFailure, Pruning, VerifySkipped
from ..tiers.migrate import MigrateReport
from ..tiers.pending import FlushRun
from ..tiers.retention import Leftover
from ..tiers.verify import VerifyResult
from .tables import table


def emit(as_json: bool, documents: list[dict[str, Any]] | dict[str, Any], lines: list[str]) -> None:
    """Results on stdout: JSON for scripts, else plain unwrapped lines (readable and grep-able)."""
    print(json.dumps(documents, indent=1) if as_json else "\n".join(lines))


def size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def rate(nbytes: int, seconds: float) -> str:
    """``0.44 GB/s``, or ``12.5 MB/s`` for slow copies (a paced migration, a network file system)."""
    return size(nbytes / seconds if seconds > 0 else 0) + "/s"


# --- ls and inspect -----------------------------------------------------------------------------
def state_text(entry: dict[str, Any]) -> str:
    """The state column of the ls table: e.g. ``verified, flushed``, ``partial (5 min old)`` or
    ``invalid (manifest.json: missing ...)``."""
    if entry["state"] in ("partial", "deleting"):
        return f"{entry['state']} ({_age(entry['age_s'])} old)"
    if entry["state"] == "invalid":
        return f"invalid ({entry['error']})"
    ranks = ", ".join(map(str, entry.get("node_ranks") or []))
    part = f", node {entry['node']}'s part (ranks {ranks})" if entry.get("node") else ""
    pending = f", flush pending ({', '.join(entry['due_on'])})" if entry.get("due_on") else ""
    return entry["state"] + (", flushed" if entry.get("flushed") else "") + pending + part


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def checkpoints(entries: list[dict[str, Any]], tier_names: Sequence[str], as_json: bool) -> int:
    if as_json:
        emit(True, entries, [])
    elif not entries:
        print(f"no checkpoints on {', '.join(tier_names)}")
    else:
        rows = [
            (e["tier"], str(e["step"]), state_text(e), str(e.get("items", "")),
             f"{e['stored_bytes']:,}" if "stored_bytes" in e else "", e.get("created", ""))
            for e in entries
        ]  # fmt: skip
        names = ("tier", "step", "state", "items", "stored bytes", "created")
        table(None, names, rows, right={"items", "stored bytes"})
    return 0


def items(document: dict[str, Any], as_json: bool) -> int:
    if as_json:
        emit(True, document, [])
        return 0
    rows = document["item_table"]
    title = f"step {document['step']}: {len(rows)} items, {document['raw_bytes']:,} bytes"
    cells = [(row["key"], row["kind"], row["type"], row["shape"], f"{row['bytes']:,}") for row in rows]
    table(title, ("key", "kind", "type", "shape", "bytes"), cells, right={"bytes"})
    return 0


# --- migrate and verify -------------------------------------------------------------------------
def _migrate_line(report: MigrateReport) -> str:
    head = f"step {report.step}: {report.source} -> {report.target}: "
    if report.outcome == "already there":
        body = "already there"
    else:
        moved = report.bytes_copied + report.bytes_reused
        body = f"{report.outcome} {report.frames_copied} of {report.frames} frames"
        if report.frames_reused:
            body += f" (resumed: {report.frames_reused} already there and verified)"
        body += f", {size(moved)} in {report.seconds:.2f} s ({rate(moved, report.seconds)}), verified, published"
    return head + body + (", source deleted" if report.moved else "")


def migrations(results: Sequence[MigrateReport | MigrateFailure], source: str, as_json: bool) -> int:
    lines = [
        f"step {r.step}: {r.source} -> {r.target}: FAILED: {r.error}" if isinstance(r, MigrateFailure)
        else _migrate_line(r)
        for r in results
    ]  # fmt: skip
    emit(as_json, [r.as_dict() for r in results], lines or [f"{source}: no committed checkpoints"])
    return 1 if any(isinstance(r, MigrateFailure) for r in results) else 0


def verifications(results: Sequence[VerifyResult | VerifySkipped], as_json: bool) -> int:
    documents, lines = [], []
    for result in results:
        if isinstance(result, VerifySkipped):
            lines.append(f"{result.tier} step {result.step}: skipped: {result.reason}")
            continue
        documents.append(result.as_dict())
        head = f"{result.tier} step {result.step}"
        if result.ok:
            lines.append(f"{head}: ok ({size(result.bytes)}, {rate(result.bytes, result.seconds)})")
        else:
            lines.append(f"{head}: FAILED")
            lines += [f"  {problem}" for problem in result.problems]
        lines += [f"  warning: {warning}" for warning in result.warnings]
    emit(as_json, documents, lines or ["no committed checkpoints"])
    return 1 if any(isinstance(r, VerifyResult) and not r.ok for r in results) else 0


# --- prune and gc -------------------------------------------------------------------------------
def pruning(done: Pruning, as_json: bool) -> int:
    """One line per step (what was or would be deleted, and its size), then the space freed."""
    if done.declined:
        emit(as_json, [], ["nothing deleted"])
        return 0
    verb = "would delete" if done.dry_run else "deleted"
    lines = [
        f"{d.tier} step {d.step}: {verb} {size(done.size(d))} ({d.reason})" if d.delete
        else f"{d.tier} step {d.step}: kept ({d.reason})"
        for d in done.decisions
    ]  # fmt: skip
    if done.doomed:
        lines.append(f"{'would free' if done.dry_run else 'freed'} {size(done.freed)} in all")
    emit(as_json, [{**d.as_dict(), "bytes": done.size(d)} for d in done.decisions], lines or ["nothing to prune"])
    return 0


def flushes(run: FlushRun, as_json: bool) -> int:
    """``tierstate flush``: each pending step's copy (or why it failed), then what retention deleted."""
    lines = []
    for outcome in run.outcomes:
        if outcome.report is not None:
            lines.append(_migrate_line(outcome.report))
            continue
        lines.append(f"step {outcome.step}: {outcome.source} -> {outcome.target}: FAILED: {outcome.error}")
        if outcome.damaged is not None:
            lines.append(f"  its copy on {outcome.source} is damaged: noted unflushable, retention may delete it")
    lines += [f"{d.tier} step {d.step}: deleted ({d.reason})" for d in run.pruned if d.delete]
    document = {"flushes": [o.as_dict() for o in run.outcomes], "pruned": [d.as_dict() for d in run.pruned]}
    emit(as_json, document, lines or ["nothing pending: every tier holds the checkpoints due on it"])
    return 1 if run.failed else 0


def prune_question(plan: Pruning) -> str:
    count = len(plan.doomed)
    return f"delete {count} checkpoint{'s' if count > 1 else ''}, freeing {size(plan.freed)}? [y/N] "


def leftovers(found: Sequence[Leftover], as_json: bool) -> int:
    lines = [
        f"{f.tier} {f.path.name if isinstance(f.path, Path) else f.path}: {f.reason} ({f.kind}, {f.age_s:.0f} s old)"
        for f in found
    ]
    emit(as_json, [f.as_dict() for f in found], lines or ["no leftovers"])
    return 0


# --- export -------------------------------------------------------------------------------------
def exported(result: Exported | ExportFailure, as_json: bool) -> int:
    if isinstance(result, ExportFailure):
        problems = "; ".join(result.problems)
        emit(as_json, [{"step": result.step, "error": problems}], [f"export failed: {problems}"])
        return 1
    report = result.report
    line = f"step {report.step} ({result.tier}): {report.items} items, {size(report.bytes)} -> {report.path}"
    emit(as_json, [{**report.as_dict(), "tier": result.tier}], [line])
    return 0
