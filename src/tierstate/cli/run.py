"""Running a parsed ``tierstate`` command line: options in, tiers and policies out, a command called,
its results rendered.

The commands (tiers/commands.py) take tier objects and return data; the tiers come from
``options`` (read as the runner reads them), the output from ``render``. Bad input (a
:class:`UsageError`, a config error, a file that is no checkpoint) is answered with one line per
line of the error on stderr and exit code 2; any other deliberate error with exit code 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import get_args

from tierstate.errors import TierstateError

from ..pipeline.config import ConfigError
from ..pipeline.packaged import packaged_config, packaged_configs
from ..tiers import commands
from ..tiers.commands import Pruning, UsageError
from ..tiers.convert import Format
from ..tiers.export import ExportFormat
from ..tiers.format import ManifestError
from ..tiers.hfdir import MAX_SHARD_SIZE
from ..tiers.pacing import Pacer
from ..tiers.pending import flush_by_hand, mark_pending
from ..tiers.policy import RetentionPolicy
from ..tiers.retention import collect_garbage
from . import options, render
from .progress import byte_progress
from .s3 import run_s3
from .stats import show_stats

# Errors that mean the request itself is wrong: printed without a traceback, exit code 2.
_BAD_INPUT = (UsageError, ConfigError, ManifestError)


def _ls(args: argparse.Namespace) -> int:
    policies = options.tiers_of(args)
    tiers = [p.tier for p in policies]
    options.must_exist(tiers)
    entries = mark_pending(commands.list_checkpoints(tiers), policies)
    return render.checkpoints(entries, [t.name for t in tiers], args.json)


def _checkpoint_dir(args: argparse.Namespace) -> Path:
    """``args.target``: a checkpoint directory (no tiers needed), or a step found on the tiers."""
    target = args.target
    if not target.isdigit():
        if not Path(target).is_dir():
            raise UsageError(f"{target}: no such checkpoint directory (or give a step number)")
        return Path(target)
    tiers = [p.tier for p in options.tiers_of(args)]
    options.must_exist(tiers)
    return commands.step_dir(tiers, int(target))


def _inspect(args: argparse.Namespace) -> int:
    return render.items(commands.inspect_checkpoint(_checkpoint_dir(args)), args.json)


def _stats(args: argparse.Namespace) -> int:
    return show_stats(_checkpoint_dir(args), args.json, args.trace)


def _migrate(args: argparse.Namespace) -> int:
    tiers = options.tiers_of(args)
    source = options.pick(tiers, args.source, "--from").tier
    target = options.pick(tiers, args.target, "--to").tier  # may not exist yet: migrate creates it
    if source.name == target.name:
        raise UsageError(f"--from and --to are both {source.name}")
    if (args.step is None) == (not args.all):
        raise UsageError("give either a STEP or --all")
    fmt = options.choice(args.format, get_args(Format), "--format")
    bandwidth = options.size(args.bandwidth, "--bandwidth") if args.bandwidth else None
    options.must_exist([source])
    results = commands.migrate_steps(
        source, target, args.step, move=args.move, fmt=fmt, bandwidth=bandwidth, progress=byte_progress(not args.json)
    )
    return render.migrations(results, source.name, args.json)


def _verify(args: argparse.Namespace) -> int:
    chosen = [p.tier for p in options.select(options.tiers_of(args), args.only, "--only")]
    options.must_exist(chosen)
    return render.verifications(commands.verify_steps(chosen, args.steps, byte_progress(not args.json)), args.json)


def _ask(question: str) -> bool:
    """A yes/no question on the terminal (stderr, so that stdout keeps only results); no by default."""
    print(question, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _prune(args: argparse.Namespace) -> int:
    tiers = options.tiers_of(args)
    chosen = options.select(tiers, args.only, "--only")
    options.must_exist([p.tier for p in chosen])
    only = {p.tier.name for p in chosen}
    if args.keep_last is not None or args.keep_every is not None:
        policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
        tiers = [replace(p, retention=policy) if p.tier.name in only else p for p in tiers]

    def confirm(plan: Pruning) -> bool:
        """The plan shown (unless --json: one JSON document on stdout, the result's), then the question."""
        if not args.json:
            render.pruning(plan, as_json=False)
        return _ask(render.prune_question(plan))

    asking = sys.stdin.isatty() and not args.yes
    done = commands.prune_tiers(tiers, only, dry_run=args.dry_run, confirm=confirm if asking else None)
    return render.pruning(done, args.json)


def _flush(args: argparse.Namespace) -> int:
    tiers = options.tiers_of(args)
    options.must_exist([p.tier for p in tiers])
    pacer = Pacer(options.size(args.bandwidth, "--bandwidth")) if args.bandwidth else None
    return render.flushes(flush_by_hand(tiers, pacer=pacer), args.json)


def _gc(args: argparse.Namespace) -> int:
    older_than = options.duration(args.older_than, "--older-than")
    chosen = [p.tier for p in options.select(options.tiers_of(args), args.only, "--only")]
    options.must_exist(chosen)
    return render.leftovers(collect_garbage(chosen, older_than, dry_run=args.dry_run), args.json)


def _export(args: argparse.Namespace) -> int:
    formats = (*get_args(ExportFormat), "dcp")
    fmt = options.choice(args.format, formats, "--format")
    if fmt is None:  # argparse requires it; said here too for a caller that builds the arguments itself
        raise UsageError(f"export needs --format (one of {', '.join(formats)})")
    shard = options.size(args.max_shard_size, "--max-shard-size") if args.max_shard_size else MAX_SHARD_SIZE
    tiers = options.tiers_of(args)
    read = [p.tier for p in ([options.pick(tiers, args.source, "--from")] if args.source else tiers)]
    options.must_exist(read)
    writer = None
    if fmt == "dcp":  # a directory, written by DCP's own writer: torch.distributed.checkpoint loads only now
        if args.provider is not None:
            raise UsageError("--provider: --format dcp exports the whole checkpoint (DCP loads any part of it)")
        from ..integrations.dcp import export_dcp

        writer = export_dcp
    result = commands.export_step(
        read, args.step, Path(args.out), fmt, args.force, args.provider, max_shard_size=shard, writer=writer,
        progress=byte_progress(not args.json),
    )  # fmt: skip
    return render.exported(result, args.json)


def _import(args: argparse.Namespace) -> int:
    """A DCP checkpoint committed as step ``--step`` on the tier ``--to``, through a runner."""
    from ..integrations.dcp import import_dcp

    target = options.pick(options.tiers_of(args), args.target, "--to").tier
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
    "flush": _flush,
    "gc": _gc,
    "export": _export,
    "import": _import,
    "init": _init,
    "s3": run_s3,
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
