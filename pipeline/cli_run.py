"""Running a parsed ``tierstate`` command line: options in, tiers and policies out, a command called.

It lives in pipeline, not in tiers, because it reads tiers exactly as the runner does: a
``--config`` YAML (or a packaged config by name) goes through
:func:`~tierstate.pipeline.config.load_config`, so a key written twice, an unknown key anywhere
(under ``pipeline:`` too) and every bad value are refused with the file and the key path, and
relative tier paths are resolved as the runner resolves them (against the working directory, see
``TierConfig``). ``--tier NAME=PATH`` goes through the same tier model. A config the runner refuses
is one the CLI refuses: retention read differently by the two could delete checkpoints the runner
keeps. The commands (tiers/commands.py) take the tiers and policies built here, never YAML.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar, cast, get_args

from pydantic import ByteSize, TypeAdapter, ValidationError

from tierstate.errors import TierstateError

from ..tiers import commands
from ..tiers.commands import UsageError
from ..tiers.convert import Format
from ..tiers.export import ExportFormat
from ..tiers.filesystem import FilesystemTier
from ..tiers.format import ManifestError
from ..tiers.hfdir import MAX_SHARD_SIZE
from ..tiers.nodes import as_node
from ..tiers.policy import RetentionPolicy
from ..tiers.retention import TierPolicies
from ..tiers.stats import show_stats
from .config import ConfigError, TierConfig, load_config, packaged_config, packaged_configs, parse_tiers

# Errors that mean the request itself is wrong: printed without a traceback, exit code 2.
_BAD_INPUT = (UsageError, ConfigError, ManifestError)

T = TypeVar("T")

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


# --- tiers from --config and --tier -------------------------------------------------------------
def _policies(name: str, tier: TierConfig) -> TierPolicies:
    return TierPolicies(FilesystemTier(name, tier.path, tier.scope), tier.retention, tier.flush)


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
        raise UsageError("no tiers: give --config FILE (or a packaged config: default, tiered) or --tier NAME=PATH")
    names = [t.tier.name for t in tiers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"tier {repeated[0]!r} is given twice")
    return tiers


def _tiers(args: argparse.Namespace) -> list[TierPolicies]:
    """The tiers of the options; with ``--node``, node-scoped tier paths are that node's (``{node}``)."""
    if not args.node:
        return load_tiers(args.config, args.tier)
    with as_node(args.node):
        return load_tiers(args.config, args.tier)


def _must_exist(read: Sequence[FilesystemTier]) -> None:
    """At least one of the tiers a command reads must be there: else a mistyped path, or a config's
    relative paths taken from another directory, would list nothing and exit 0. One that is not there
    is noted on stderr and read as empty (a tier may not be written yet, e.g. a flush tier before its
    first flush)."""
    missing = [tier for tier in read if not tier.root.is_dir()]
    if missing and len(missing) == len(read):
        where = ", ".join(f"{tier.name} ({tier.root})" for tier in missing)
        raise UsageError(
            f"no such tier directory: {where}; relative paths are taken from the working directory ({os.getcwd()})"
        )
    for tier in missing:
        print(f"tierstate: note: tier {tier.name} has no directory {tier.root} (yet); taken as empty", file=sys.stderr)


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


def _choice(text: str | None, choices: Collection[T], option: str) -> T | None:
    """``text`` if it is one of ``choices`` (or None, the option not given); else the option is named."""
    for choice in choices:
        if text == choice:
            return choice
    if text is not None:
        raise UsageError(f"{option} {text!r}: expected one of {', '.join(map(str, choices))}")
    return None


def _ask(question: str) -> bool:
    """A yes/no question on the terminal (stderr, so that stdout keeps only results); no by default."""
    print(question, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


# --- the commands, from parsed options ----------------------------------------------------------
def _ls(args: argparse.Namespace) -> int:
    tiers = [p.tier for p in _tiers(args)]
    _must_exist(tiers)
    return commands.list_checkpoints(tiers, args.json)


def _checkpoint_dir(args: argparse.Namespace) -> Path:
    """``args.target``: a checkpoint directory (no tiers needed), or a step found on the tiers."""
    target = args.target
    if not target.isdigit():
        if not Path(target).is_dir():
            raise UsageError(f"{target}: no such checkpoint directory (or give a step number)")
        return Path(target)
    tiers = [p.tier for p in _tiers(args)]
    _must_exist(tiers)
    return commands.step_dir(tiers, int(target))


def _inspect(args: argparse.Namespace) -> int:
    return commands.inspect_checkpoint(_checkpoint_dir(args), args.json)


def _stats(args: argparse.Namespace) -> int:
    return show_stats(_checkpoint_dir(args), args.json)


def _migrate(args: argparse.Namespace) -> int:
    tiers = _tiers(args)
    source = _pick(tiers, args.source, "--from").tier
    target = _pick(tiers, args.target, "--to").tier  # may not exist yet: migrate creates it
    if source.name == target.name:
        raise UsageError(f"--from and --to are both {source.name}")
    if (args.step is None) == (not args.all):
        raise UsageError("give either a STEP or --all")
    fmt = _choice(args.format, get_args(Format), "--format")
    bandwidth = _size(args.bandwidth, "--bandwidth") if args.bandwidth else None
    _must_exist([source])
    return commands.migrate_steps(
        source, target, args.step, move=args.move, fmt=fmt, bandwidth=bandwidth, as_json=args.json
    )


def _verify(args: argparse.Namespace) -> int:
    chosen = [p.tier for p in _select(_tiers(args), args.only, "--only")]
    _must_exist(chosen)
    return commands.verify_steps(chosen, args.steps, args.json)


def _prune(args: argparse.Namespace) -> int:
    tiers = _tiers(args)
    chosen = _select(tiers, args.only, "--only")
    _must_exist([p.tier for p in chosen])
    only = {p.tier.name for p in chosen}
    if args.keep_last is not None or args.keep_every is not None:
        policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
        tiers = [replace(p, retention=policy) if p.tier.name in only else p for p in tiers]
    confirm = _ask if sys.stdin.isatty() and not args.yes else None
    return commands.prune_tiers(tiers, only, dry_run=args.dry_run, as_json=args.json, confirm=confirm)


def _gc(args: argparse.Namespace) -> int:
    older_than = _duration(args.older_than, "--older-than")
    chosen = [p.tier for p in _select(_tiers(args), args.only, "--only")]
    _must_exist(chosen)
    return commands.collect_leftovers(chosen, older_than, dry_run=args.dry_run, as_json=args.json)


def _export(args: argparse.Namespace) -> int:
    fmt = _choice(args.format, (*get_args(ExportFormat), "dcp"), "--format")
    assert fmt is not None  # argparse requires --format
    shard = _size(args.max_shard_size, "--max-shard-size") if args.max_shard_size else MAX_SHARD_SIZE
    tiers = [p.tier for p in ([_pick(_tiers(args), args.source, "--from")] if args.source else _tiers(args))]
    _must_exist(tiers)
    writer = None
    if fmt == "dcp":  # a directory, written by DCP's own writer: torch.distributed.checkpoint loads only now
        if args.provider is not None:
            raise UsageError("--provider: --format dcp exports the whole checkpoint (DCP loads any part of it)")
        from tierstate.integrations.dcp import export_dcp

        # the cast: type checkers see this repository's tiers/ and the installed tierstate.tiers as two modules
        writer = cast(commands.Writer, export_dcp)
    return commands.export_step(
        tiers, args.step, Path(args.out), fmt, args.json, args.force, args.provider, max_shard_size=shard, writer=writer
    )


def _import(args: argparse.Namespace) -> int:
    """A DCP checkpoint committed as step ``--step`` on the tier ``--to``, through a runner."""
    from tierstate.integrations.dcp import import_dcp

    target = _pick(_tiers(args), args.target, "--to").tier
    source = Path(args.source)
    if not (source / ".metadata").is_file():
        raise UsageError(f"{source}: not a DCP checkpoint directory (it has no .metadata file)")
    if args.step in target.steps():
        raise UsageError(f"--step {args.step}: tier {target.name} holds a checkpoint step {args.step} already")
    report = import_dcp(source, target.name, target.root, args.step, allow_pickle=args.allow_pickle)
    names = ", ".join(f"{name} ({layout})" for name, layout in report.names.items())
    line = f"step {report.step} ({report.tier}): {report.items} items, {report.bytes:,} bytes from {source}: {names}"
    print(json.dumps(report.as_dict(), indent=1) if args.json else line)
    return 0


def _init(args: argparse.Namespace) -> int:
    """Copy a packaged config, comments and all, to DIRECTORY/NAME.yaml for the user to edit."""
    name = args.name.removesuffix(".yaml")
    if name not in packaged_configs():
        raise UsageError(f"--from {args.name!r}: no such packaged config (packaged: {', '.join(packaged_configs())})")
    out = Path(args.directory) / f"{name}.yaml"
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists; give --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(packaged_config(name), out)
    print(f"wrote {out}: edit it, then Runner.from_yaml({str(out)!r}) or tierstate ls --config {out}")
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": _ls,
    "inspect": _inspect,
    "stats": _stats,
    "migrate": _migrate,
    "verify": _verify,
    "prune": _prune,
    "gc": _gc,
    "export": _export,
    "import": _import,
    "init": _init,
}


def run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names; its exit code (bad input printed and answered with 2)."""
    try:
        return _COMMANDS[args.command](args)
    except _BAD_INPUT as exc:
        _complain(exc)
        return 2
    except TierstateError as exc:  # a checkpoint that cannot be read or written as asked: named, no traceback
        _complain(exc)
        return 1


def _complain(exc: Exception) -> None:
    for line in str(exc).splitlines():
        print(f"tierstate: {line}", file=sys.stderr)
