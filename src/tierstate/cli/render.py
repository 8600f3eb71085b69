"""How the results of the ``tierstate`` commands look: plain lines, tables, or one JSON document.

Results go to stdout: with ``--json`` one JSON document for scripts; else plain lines, one per
checkpoint, never cut (ls and inspect: a table, drawn with rich on a terminal, padded columns
otherwise, for grep and awk). Each function that renders a command's results returns the exit
code they mean: 0 when everything asked for was done, 1 when some checkpoint failed.

Sizes and rates in lines are written one way, the progress bars' (rich's decimal units: ``67.1 MB``,
``1.5 GB``, ``440.0 MB/s``), so a bar and the line after it say the same; tables of checkpoints keep
exact byte counts (``67,129,344``) in a column that says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.filesize import decimal

from ..tiers.ops.migrate import MigrateReport
from ..tiers.ops.pending import FlushOutcome, FlushRun
from ..tiers.ops.retention import Leftover
from ..tiers.ops.verify import VerifyResult
from .commands import Exported, ExportFailure, MigrateFailure, Pruning, VerifySkipped
from .tables import table


def emit(as_json: bool, documents: list[dict[str, Any]] | dict[str, Any], lines: list[str]) -> None:
    """Results on stdout: JSON for scripts, else plain unwrapped lines (readable and grep-able)."""
    print(json.dumps(documents, indent=1) if as_json else "\n".join(lines))


def size(nbytes: float) -> str:
    """``67.1 MB``: as the progress bars write sizes (cli/progress.py)."""
    return decimal(round(nbytes))


def rate(nbytes: int, seconds: float) -> str:
    """``440.0 MB/s``: as the progress bars write speeds."""
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
def migrate_line(report: MigrateReport) -> str:
    """One migration: the frames and bytes it copied, and its rate over those bytes alone (frames a resumed
    copy found already there were read back and verified, not copied: counting them would inflate it)."""
    head = f"step {report.step}: {report.source} -> {report.target}: "
    if not report.published:
        body = "already there"
    else:
        copied = size(report.bytes_copied)
        body = f"{report.outcome} {report.frames_copied} of {report.frames} frames"
        if report.frames_reused:
            body += f" (resumed: {report.frames_reused} already there and verified)"
            copied += f" of {size(report.bytes_copied + report.bytes_reused)}"
        speed = rate(report.bytes_copied, report.seconds)
        body += f", {copied} in {report.seconds:.2f} s ({speed}), verified, published"
    return head + body + (", source deleted" if report.moved else "")


def migration_line(result: MigrateReport | MigrateFailure) -> str:
    if isinstance(result, MigrateFailure):
        return f"step {result.step}: {result.source} -> {result.target}: FAILED: {result.error}"
    return migrate_line(result)


def migrations(results: Sequence[MigrateReport | MigrateFailure], source: str, as_json: bool, shown: bool) -> int:
    """``tierstate migrate``'s result; ``shown``: each step's line was printed as it ended."""
    lines = [] if shown else [migration_line(r) for r in results]
    if as_json or lines or not results:
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


def flush_lines(outcome: FlushOutcome) -> list[str]:
    """One pending step's copy to one tier: what it copied, or why it failed."""
    if outcome.report is not None:
        return [migrate_line(outcome.report)]
    lines = [f"step {outcome.step}: {outcome.source} -> {outcome.target}: FAILED: {outcome.error}"]
    if outcome.damaged is not None:
        lines.append(f"  its copy on {outcome.source} is damaged: noted unflushable, retention may delete it")
    return lines


def flushes(run: FlushRun, as_json: bool, shown: bool) -> int:
    """``tierstate flush``: each pending step's copy (unless ``shown``: printed as each ended), then what
    retention deleted."""
    lines = [] if shown else [line for outcome in run.outcomes for line in flush_lines(outcome)]
    lines += [f"{d.tier} step {d.step}: deleted ({d.reason})" for d in run.pruned if d.delete]
    if not run.outcomes and not lines:
        lines = ["nothing pending: every tier holds the checkpoints due on it"]
    document = {"flushes": [o.as_dict() for o in run.outcomes], "pruned": [d.as_dict() for d in run.pruned]}
    if as_json or lines:
        emit(as_json, document, lines)
    return 1 if run.failed else 0


def interrupted(command: str, published: Sequence[str], undone: str) -> str:
    """What an interrupted ``migrate`` or ``flush`` had done: the copies it published (each complete and
    verified), and what it had not."""
    done = f"published before it: {', '.join(published)}" if published else "nothing published before it"
    return f"tierstate {command}: interrupted; {done}; {undone}"


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


def node_state(found: list[dict[str, Any]]) -> None:
    """One line per agent and per slot pool (cli/commands.py ``node_state``), under the ls table."""
    for entry in found:
        if "agent" in entry:
            print(f"agent on {entry['tier']}: {entry['agent']}")
        else:
            print(f"slots on {entry['tier']}: rank {entry['rank']}: {entry['free_files']} free file(s), "
                  f"{size(entry['allocated_bytes'])} allocated")
