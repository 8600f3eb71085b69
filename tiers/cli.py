"""The ``tierstate`` command: look at checkpoints on their tiers without a runner.

Tiers come from a pipeline YAML (``--config``) or from ``--tier NAME=PATH`` options, so the tool
needs nothing but the files. Tables are printed with rich; ``--json`` prints plain JSON for scripts.
The tiers package must not import pipeline, so the YAML is read here only for its ``tiers`` section.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from tiers.filesystem import FilesystemTier
from tiers.format import AliasRecord, Manifest, ManifestError, ObjectRecord, read_manifest


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit code 2."""


def _tiers_from_yaml(path: str) -> list[FilesystemTier]:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"{path}: cannot read config: {exc}") from None
    tiers = doc.get("tiers") if isinstance(doc, dict) else None
    if not isinstance(tiers, dict) or not tiers:
        raise UsageError(f"{path}: tiers: no tiers defined")
    found = []
    for name, spec in tiers.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
            raise UsageError(f"{path}: tiers.{name}.path: expected a directory path")
        found.append(FilesystemTier(str(name), Path(spec["path"]).expanduser().resolve()))
    return found


def _tiers(args: argparse.Namespace) -> list[FilesystemTier]:
    tiers = _tiers_from_yaml(args.config) if args.config else []
    for spec in args.tier or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--tier {spec!r}: expected NAME=PATH")
        tiers.append(FilesystemTier(name, Path(path).expanduser().resolve()))
    if not tiers:
        raise UsageError("no tiers: give --config FILE or --tier NAME=PATH")
    return tiers


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
    }


def _item_rows(manifest: Manifest) -> list[dict[str, Any]]:
    rows = []
    for key, record in manifest.items.items():
        if isinstance(record, AliasRecord):
            rows.append({"key": key, "kind": "alias", "type": f"= {record.of}", "shape": "", "bytes": 0})
        elif isinstance(record, ObjectRecord):
            rows.append({"key": key, "kind": "object", "type": record.serializer, "shape": "", "bytes": record.length})
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
    for tier in _tiers(args):
        for step in tier.steps():
            try:
                entry = {"tier": tier.name, "state": "committed", **_summary(tier.manifest(step))}
            except ManifestError as exc:
                entry = {"tier": tier.name, "step": step, "state": "invalid", "error": str(exc)}
            entries.append(entry)
        for partial in tier.partials():
            entries.append({"tier": tier.name, "step": partial.name, "state": "partial"})
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    table = Table(title="checkpoints")
    for column in ("tier", "step", "state", "items", "stored bytes", "created"):
        table.add_column(column)
    for e in entries:
        stored = f"{e['stored_bytes']:,}" if "stored_bytes" in e else ""
        table.add_row(e["tier"], str(e["step"]), e["state"], str(e.get("items", "")), stored, e.get("created", ""))
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstate", description="Inspect tierstate checkpoints across tiers.")
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
