"""The ``tierstate`` command (also ``python -m tiers``): checkpoints on their tiers, without a runner.

Tiers come from a pipeline YAML (``--config``) or from ``--tier NAME=PATH`` options (see
tiers/tierspec.py), so the tool needs nothing but the files. Tables are printed with rich; ``--json``
prints plain JSON for scripts. ``ls`` and ``inspect`` live here; the commands that move, check and
delete checkpoints (migrate, verify, prune, gc, export) in tiers/commands.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .catalog import copy_state, leftover_entries, state_text
from .commands import add_commands
from .filesystem import FilesystemTier
from .format import (
    AliasRecord,
    Manifest,
    ManifestError,
    ObjectRecord,
    PerRankRecord,
    ShardedRecord,
    read_manifest,
)
from .tierspec import UsageError, load_tiers


def _tiers(args: argparse.Namespace) -> list[FilesystemTier]:
    return [policies.tier for policies in load_tiers(args.config, args.tier)]


def _checkpoint_dir(args: argparse.Namespace) -> Path:
    """``inspect`` takes a checkpoint directory, or a step found on the given tiers."""
    target = args.target
    if not target.isdigit():
        return Path(target)
    step = int(target)
    for tier in _tiers(args):
        if step in tier.steps():
            return tier.step_dir(step)
    raise UsageError(f"step {step}: no committed checkpoint on any tier")


def _summary(manifest: Manifest) -> dict[str, Any]:
    return {
        "step": manifest.step,
        "created": manifest.created,
        "items": len(manifest.items),
        "raw_bytes": manifest.raw_bytes,
        "stored_bytes": manifest.stored_bytes,
        "files": len(manifest.files),
        "ranks": manifest.world_size,
    }


def _item_rows(manifest: Manifest) -> list[dict[str, Any]]:
    rows = []
    for key, record in manifest.items.items():
        if isinstance(record, AliasRecord):
            rows.append({"key": key, "kind": "alias", "type": f"= {record.of}", "shape": "", "bytes": 0})
        elif isinstance(record, ObjectRecord):
            rows.append({"key": key, "kind": "object", "type": record.serializer, "shape": "", "bytes": record.length})
        elif isinstance(record, PerRankRecord):
            held = f"{len(record.ranks)} ranks"
            rows.append({"key": key, "kind": "per-rank", "type": held, "shape": "", "bytes": manifest.item_nbytes(key)})
        elif isinstance(record, ShardedRecord):
            shape = "x".join(map(str, record.global_shape)) or "scalar"
            nbytes = manifest.item_nbytes(key)
            rows.append({"key": key, "kind": "sharded", "type": record.dtype, "shape": shape, "bytes": nbytes})
        else:
            shape = "x".join(map(str, record.shape)) or "scalar"
            rows.append(
                {"key": key, "kind": "tensor", "type": record.dtype, "shape": shape, "bytes": manifest.item_nbytes(key)}
            )
    return rows


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    manifest = read_manifest(_checkpoint_dir(args))
    rows = _item_rows(manifest)
    if args.json:
        print(json.dumps({**_summary(manifest), "item_table": rows}, indent=1))
        return 0
    table = Table(title=f"step {manifest.step}: {len(rows)} items, {manifest.raw_bytes:,} bytes")
    for column in ("key", "kind", "type", "shape", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for row in rows:
        table.add_row(row["key"], row["kind"], row["type"], row["shape"], f"{row['bytes']:,}")
    console.print(table)
    return 0


def cmd_ls(args: argparse.Namespace, console: Console) -> int:
    entries = []
    tiers = _tiers(args)
    for tier in tiers:
        for step in tier.steps():
            try:
                entry = {"tier": tier.name, **copy_state(tiers, tier, step), **_summary(tier.manifest(step))}
            except ManifestError as exc:
                entry = {"tier": tier.name, "step": step, "state": "invalid", "error": str(exc)}
            entries.append(entry)
        entries += leftover_entries(tier)
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    table = Table(title="checkpoints")
    for column in ("tier", "step", "state", "items", "stored bytes", "created"):
        table.add_column(column)
    for e in entries:
        stored = f"{e['stored_bytes']:,}" if "stored_bytes" in e else ""
        created = e.get("created", "")
        table.add_row(e["tier"], str(e["step"]), state_text(e), str(e.get("items", "")), stored, created)
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstate", description="Checkpoints across tiers: list, move, check.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="pipeline YAML whose tiers to use")
    common.add_argument("--tier", action="append", metavar="NAME=PATH", help="a tier directory (repeatable)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", parents=[common], help="list checkpoints on every tier")
    ls.set_defaults(fn=cmd_ls)
    inspect = sub.add_parser("inspect", parents=[common], help="show a checkpoint's manifest as a table")
    inspect.add_argument("target", help="a checkpoint directory, or a step number found on the tiers")
    inspect.set_defaults(fn=cmd_inspect)
    add_commands(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        return args.fn(args, console)
    except (UsageError, ManifestError) as exc:
        print(f"tierstate: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
