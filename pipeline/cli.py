"""The ``tierstate`` command line (also ``python -m tierstate``): options in, tiers and policies out.

It lives in pipeline, not in tiers, because it reads tiers exactly as the runner does: a
``--config`` YAML goes through :func:`~tierstate.pipeline.config.load_config`, so a key written
twice, an unknown key anywhere (under ``pipeline:`` too) and every bad value are refused with the
file and the key path, and relative tier paths are resolved as the runner resolves them (against
the working directory, see ``TierConfig``). ``--tier NAME=PATH`` goes through the same tier model.
A config the runner refuses is one the CLI refuses: retention read differently by the two could
delete checkpoints the runner keeps. The commands (tiers/commands.py) take the tiers and policies
built here, never YAML. Exit codes: 0 done, 1 some checkpoint failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from pydantic import ByteSize, TypeAdapter, ValidationError

from tierstate.errors import TierstateError

from ..tiers import commands
from ..tiers.commands import UsageError
from ..tiers.convert import FORMATS
from ..tiers.export import EXPORT_FORMATS
from ..tiers.filesystem import FilesystemTier
from ..tiers.format import ManifestError
from ..tiers.policy import RetentionPolicy
from ..tiers.retention import TierPolicies
from .config import ConfigError, TierConfig, load_config, parse_tiers

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


# --- tiers from --config and --tier -------------------------------------------------------------
def _policies(name: str, tier: TierConfig) -> TierPolicies:
    return TierPolicies(FilesystemTier(name, tier.path), tier.retention, tier.flush)


def _tier_option(spec: str) -> TierPolicies:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise UsageError(f"--tier {spec!r}: expected NAME=PATH")
    [(name, tier)] = parse_tiers({name: {"path": path}}, source=f"--tier {spec!r}").items()
    return _policies(name, tier)


def load_tiers(config: str | None, tier_options: Sequence[str] | None) -> list[TierPolicies]:
    """The tiers of ``--config`` (with their policies, read as the runner reads them), followed by
    those of ``--tier NAME=PATH`` (no policies)."""
    tiers = [_policies(name, tier) for name, tier in load_config(config).tiers.items()] if config else []
    tiers += [_tier_option(spec) for spec in tier_options or []]
    if not tiers:
        raise UsageError("no tiers: give --config FILE or --tier NAME=PATH")
    names = [t.tier.name for t in tiers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"tier {repeated[0]!r} is given twice")
    return tiers


def _tiers(args: argparse.Namespace) -> list[TierPolicies]:
    return load_tiers(args.config, args.tier)


def _pick(tiers: Sequence[TierPolicies], name: str, option: str) -> TierPolicies:
    """The tier called ``name``; the error names the option and the tiers there are."""
    for policies in tiers:
        if policies.tier.name == name:
            return policies
    known = ", ".join(t.tier.name for t in tiers)
    raise UsageError(f"{option} {name}: no such tier (tiers: {known})")


def _select(tiers: Sequence[TierPolicies], names: Sequence[str] | None, option: str) -> list[TierPolicies]:
    """The tiers named by a repeatable option, in tier order; all of them when it was not given."""
    if not names:
        return list(tiers)
    chosen = {_pick(tiers, name, option).tier.name for name in names}
    return [t for t in tiers if t.tier.name in chosen]


# --- option values ------------------------------------------------------------------------------
def _duration(text: str, option: str) -> float:
    """Seconds from ``90``, ``30s``, ``10m``, ``2h`` or ``1d``."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise UsageError(f"{option} {text!r}: expected a duration such as 90, 30s, 10m, 2h or 1d")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def _size(text: str, option: str) -> int:
    """Bytes from ``200MB``, ``1GiB`` or a plain number, as sizes are written in the config."""
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise UsageError(f"{option} {text!r}: expected a size such as 200MB, 1GiB or a number of bytes") from None
    if size <= 0:
        raise UsageError(f"{option} {text!r}: must be more than 0 bytes")
    return size


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number")
    return int(text)


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


# --- the commands, from parsed options ----------------------------------------------------------
def _ls(args: argparse.Namespace) -> int:
    return commands.list_checkpoints([p.tier for p in _tiers(args)], args.json)


def _inspect(args: argparse.Namespace) -> int:
    """``inspect`` takes a checkpoint directory (no tiers needed), or a step found on the tiers."""
    target = args.target
    directory = commands.step_dir([p.tier for p in _tiers(args)], int(target)) if target.isdigit() else Path(target)
    return commands.inspect_checkpoint(directory, args.json)


def _migrate(args: argparse.Namespace) -> int:
    tiers = _tiers(args)
    source = _pick(tiers, args.source, "--from").tier
    target = _pick(tiers, args.target, "--to").tier
    if source.name == target.name:
        raise UsageError(f"--from and --to are both {source.name}")
    if (args.step is None) == (not args.all):
        raise UsageError("give either a STEP or --all")
    bandwidth = _size(args.bandwidth, "--bandwidth") if args.bandwidth else None
    return commands.migrate_steps(
        source, target, args.step, move=args.move, fmt=args.format, bandwidth=bandwidth, as_json=args.json
    )


def _verify(args: argparse.Namespace) -> int:
    chosen = _select(_tiers(args), args.only, "--only")
    return commands.verify_steps([p.tier for p in chosen], args.steps, args.json)


def _prune(args: argparse.Namespace) -> int:
    tiers = _tiers(args)
    only = {p.tier.name for p in _select(tiers, args.only, "--only")}
    if args.keep_last is not None or args.keep_every is not None:
        policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
        tiers = [replace(p, retention=policy) if p.tier.name in only else p for p in tiers]
    return commands.prune_tiers(tiers, only, dry_run=args.dry_run, as_json=args.json)


def _gc(args: argparse.Namespace) -> int:
    chosen = [p.tier for p in _select(_tiers(args), args.only, "--only")]
    older_than = _duration(args.older_than, "--older-than")
    return commands.collect_leftovers(chosen, older_than, dry_run=args.dry_run, as_json=args.json)


def _export(args: argparse.Namespace) -> int:
    tiers = [_pick(_tiers(args), args.source, "--from")] if args.source else _tiers(args)
    return commands.export_step([p.tier for p in tiers], args.step, Path(args.out), args.format, args.json)


# --- wiring -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstate", description="Checkpoints across tiers: list, move, check.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="pipeline YAML whose tiers (and policies) to use, read as the runner reads it")
    common.add_argument("--tier", action="append", metavar="NAME=PATH", help="a tier directory (repeatable)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run: Callable[[argparse.Namespace], int], text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, parents=[common], help=text, description=text)
        parser.set_defaults(run=run)
        return parser

    def only(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--only", action="append", metavar="TIER", help="work on this tier only (repeatable)")

    command("ls", _ls, "list checkpoints on every tier")
    i = command("inspect", _inspect, "show a checkpoint's manifest as a table")
    i.add_argument("target", help="a checkpoint directory, or a step number found on the tiers")

    m = command("migrate", _migrate, "copy (or --move) committed checkpoints to another tier, verified")
    m.add_argument("step", nargs="?", type=_step, help="the step to migrate (or --all)")
    m.add_argument("--all", action="store_true", help="every committed step of the --from tier")
    m.add_argument("--from", dest="source", required=True, metavar="TIER", help="tier to copy from")
    m.add_argument("--to", dest="target", required=True, metavar="TIER", help="tier to copy to")
    m.add_argument("--move", action="store_true", help="delete the source copy once the target's is published")
    m.add_argument("--format", choices=FORMATS, help="rewrite in this container format (default: keep it)")
    m.add_argument("--bandwidth", metavar="SIZE", help="bytes per second to use at most, e.g. 200MB")

    v = command("verify", _verify, "recompute every checksum; exit 1 naming file and frame of any mismatch")
    v.add_argument("steps", nargs="*", type=_step, metavar="STEP", help="steps to verify (default: all)")
    only(v)

    p = command("prune", _prune, "delete the checkpoints retention does not keep")
    p.add_argument("--keep-last", type=_at_least_one, metavar="N", help="keep the N newest steps (overrides the YAML)")
    p.add_argument("--keep-every", type=_at_least_one, metavar="K", help="keep steps that are multiples of K")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    only(p)

    g = command("gc", _gc, "remove .partial leftovers older than a bound, and .deleting ones")
    g.add_argument("--older-than", default="1h", metavar="AGE", help="e.g. 30m, 2h, 1d (default 1h)")
    g.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    only(g)

    e = command("export", _export, "write one checkpoint as a single HDF5 or safetensors file")
    e.add_argument("step", type=_step, help="the step to export")
    e.add_argument("out", help="the file to write")
    e.add_argument("--format", choices=EXPORT_FORMATS, required=True, help="hdf5 or safetensors")
    e.add_argument("--from", dest="source", metavar="TIER", help="read this tier's copy (default: fastest good one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ConfigError, ManifestError) as exc:
        _complain(exc)
        return 2
    except TierstateError as exc:  # a checkpoint that cannot be read or written as asked: named, no traceback
        _complain(exc)
        return 1


def _complain(exc: Exception) -> None:
    for line in str(exc).splitlines():
        print(f"tierstate: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
