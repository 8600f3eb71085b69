"""Running a parsed ``tierstate`` command line: options in, tiers and policies out, a command called,
its results rendered.

The commands (src/tierstate/cli/commands.py) take tier objects and return data; the tiers come from
``options`` (read as the runner reads them), the output from ``render``. Bad input (a
:class:`UsageError`, a config error, a file that is no checkpoint) is answered with one line per
line of the error on stderr and exit code 2; any other deliberate error with exit code 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import get_args

from tierstate.errors import TierstateError, UsageError

from ..pipeline.config import ConfigError
from ..pipeline.packaged import packaged_config, packaged_configs
from ..suggest import did_you_mean
from ..tiers.format.convert import Format
from ..tiers.format.format import ManifestError
from ..tiers.format.names import parse_step_name
from ..tiers.ops.export import ExportFormat
from ..tiers.ops.hfdir import MAX_SHARD_SIZE
from ..tiers.ops.migrate import MigrateReport
from ..tiers.ops.pacing import Pacer
from ..tiers.ops.pending import FlushOutcome, flush_by_hand, mark_pending, pending_flushes
from ..tiers.ops.policy import RetentionPolicy
from ..tiers.ops.retention import collect_garbage, graph_of
from ..tiers.reading.stored import Location, StoredCheckpoint
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.tier import Tier
from . import commands, options, render
from .buckets import bucket_entries, bucket_garbage
from .commands import MigrateFailure, Pruning
from .progress import byte_progress
from .s3 import run_s3
from .stats import show_stats, write_trace

# Errors that mean the request itself is wrong: printed without a traceback, exit code 2.
_BAD_INPUT = (UsageError, ConfigError, ManifestError)


def _ls(args: argparse.Namespace) -> int:
    policies, buckets = options.split(options.every_tier(args))
    tiers = [p.tier for p in policies]
    options.must_exist(tiers)
    graph = graph_of(policies, [(b.tier.name, b.flush) for b in buckets])
    entries = mark_pending(commands.list_checkpoints(tiers), policies, graph)
    entries += [entry for bucket in buckets for entry in bucket_entries(bucket.tier)]
    render.checkpoints(entries, [t.tier.name for t in [*policies, *buckets]], args.json)
    if not args.json:  # the processes and memory beside the tiers, below the table
        render.node_state(commands.node_state(tiers))
    return 0


def _checkpoint(args: argparse.Namespace) -> Location:
    """``args.target``: a checkpoint directory or ``s3://bucket/prefix/step-N`` (no tiers needed), or a
    step found on the tiers (directories first, then buckets)."""
    target = args.target
    if target.startswith("s3://"):
        prefix, _, last = target.rstrip("/").rpartition("/")
        step = parse_step_name(last)
        if step is None:
            raise UsageError(f"{target}: an s3:// checkpoint ends in /step-N (or give a step number and --tier)")
        return options.bucket_at(prefix, args).tier.source(step)
    if not target.isdigit():
        if not Path(target).is_dir():
            raise UsageError(f"{target}: no such checkpoint directory (or give a step number)")
        return Path(target)
    policies, buckets = options.split(options.every_tier(args))
    tiers = [p.tier for p in policies]
    options.must_exist(tiers)
    return commands.step_location([*tiers, *(b.tier for b in buckets)], int(target))


def _inspect(args: argparse.Namespace) -> int:
    return render.items(commands.inspect_checkpoint(_checkpoint(args)), args.json)


def _stats(args: argparse.Namespace) -> int:
    return show_stats(_checkpoint(args), args.json, args.trace)


def _trace(args: argparse.Namespace) -> int:
    """``tierstate trace STEP``: the timeline ``stats --trace`` writes, as a command of its own."""
    location = _checkpoint(args)
    manifest = StoredCheckpoint(location).manifest
    out = Path(args.output or f"trace-step-{manifest.step}.json")
    note = write_trace(manifest, out)
    print(json.dumps({"step": manifest.step, "trace": str(out)}) if args.json else note)
    return 0


def _directories(tiers: Sequence[Tier]) -> None:
    """:func:`options.must_exist` for the directory tiers among ``tiers`` (a bucket was checked when built)."""
    options.must_exist([d for t in tiers if (d := t.as_directory()) is not None])


def _migrate(args: argparse.Namespace) -> int:
    tiers = options.every_tier(args)
    source = options.pick(tiers, args.source, "--from").tier
    target = options.pick(tiers, args.target, "--to").tier  # may not exist yet: migrate creates it
    if source.name == target.name:
        raise UsageError(f"--from and --to are both {source.name}")
    if (args.step is None) == (not args.all):
        raise UsageError("give either a STEP or --all")
    fmt = options.choice(args.format, get_args(Format), "--format")
    bandwidth = options.size(args.bandwidth, "--bandwidth") if args.bandwidth else None
    _directories([source])
    done: list[MigrateReport | MigrateFailure] = []

    def each(result: MigrateReport | MigrateFailure) -> None:
        done.append(result)
        if not args.json:
            print(render.migration_line(result), flush=True)

    try:
        commands.migrate_steps(
            source, target, args.step, move=args.move, fmt=fmt, bandwidth=bandwidth,
            progress=byte_progress(not args.json), each=each,
        )  # fmt: skip
    except KeyboardInterrupt:
        published = [f"step {r.step} on {r.target}" for r in done if isinstance(r, MigrateReport) and r.published]
        undone = "the step being copied was not published (the same command again resumes it)"
        return _interrupted(args, render.interrupted("migrate", published, undone), [r.as_dict() for r in done])
    return render.migrations(done, source.name, args.json, shown=True)


def _verify(args: argparse.Namespace) -> int:
    chosen = [p.tier for p in options.select(options.every_tier(args), args.only, "--only")]
    _directories(chosen)
    return render.verifications(commands.verify_steps(chosen, args.steps, byte_progress(not args.json)), args.json)


def _ask(question: str) -> bool:
    """A yes/no question on the terminal (stderr, so that stdout keeps only results); no by default."""
    print(question, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _prune(args: argparse.Namespace) -> int:
    every = options.every_tier(args)
    chosen = options.select(every, args.only, "--only")
    _directories([p.tier for p in chosen])
    only = {p.tier.name for p in chosen}
    if args.keep_last is not None or args.keep_every is not None:
        policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
        every = [replace(p, retention=policy) if p.tier.name in only else p for p in every]
    tiers, buckets = options.split(every)

    def confirm(plan: Pruning) -> bool:
        """The plan shown (unless --json: one JSON document on stdout, the result's), then the question."""
        if not args.json:
            render.pruning(plan, as_json=False)
        return _ask(render.prune_question(plan))

    asking = sys.stdin.isatty() and not args.yes
    done = commands.prune_tiers(tiers, only, dry_run=args.dry_run, confirm=confirm if asking else None, buckets=buckets)
    return render.pruning(done, args.json)


def _flush(args: argparse.Namespace) -> int:
    """Each pending copy's line as it ends, under one bar over the bytes due (a step's bytes count once its
    copy has ended: the copies report nothing while they run); after Ctrl-C, what was published."""
    tiers, buckets = options.split(options.every_tier(args))
    options.must_exist([p.tier for p in tiers])
    pacer = Pacer(options.size(args.bandwidth, "--bandwidth")) if args.bandwidth else None
    graph = graph_of(tiers, [(b.tier.name, b.flush) for b in buckets])
    due = {(p.step, p.source.name, target): _stored_bytes(p.source, p.step)
           for p in pending_flushes(tiers, graph=graph) for target in p.targets}  # fmt: skip
    done: list[FlushOutcome] = []
    with byte_progress(not args.json and bool(due))("flush", sum(due.values())) as advance:

        def each(outcome: FlushOutcome) -> None:
            done.append(outcome)
            advance(due.get((outcome.step, outcome.source, outcome.target), 0))
            if not args.json:
                print("\n".join(render.flush_lines(outcome)), flush=True)

        try:
            run = flush_by_hand(tiers, buckets, pacer=pacer, each=each)
        except KeyboardInterrupt:
            published = [f"step {o.step} on {o.target}" for o in done if o.report is not None and o.report.published]
            undone = "retention did not run (`tierstate flush` again copies the rest, resuming a half-copied step)"
            document = {"flushes": [o.as_dict() for o in done], "pruned": [], "interrupted": True}
            return _interrupted(args, render.interrupted("flush", published, undone), document)
    return render.flushes(run, args.json, shown=True)


def _stored_bytes(tier: FilesystemTier, step: int) -> int:
    """What the bar counts for a step: its stored bytes, or 0 for a copy whose manifest does not read (its
    flush fails, and says why, on its own line)."""
    try:
        return tier.manifest(step).stored_bytes
    except (TierstateError, OSError):
        return 0


def _interrupted(args: argparse.Namespace, summary: str, document: object) -> int:
    """Ctrl-C in a command that publishes step by step: what it published, said once (with ``--json``,
    as the document of the steps that ended), and exit code 130."""
    if args.json:
        print(json.dumps(document, indent=1))
    print(summary, file=sys.stderr)
    return 130


def _agent(args: argparse.Namespace) -> int:
    """The node agent in the foreground (pipeline/agent.py); what it does goes to stderr (its log file)."""
    from ..pipeline.agent import run_agent

    if not args.config:
        raise UsageError("agent needs --config: the pipeline YAML (or the config.json a runner wrote) it flushes for")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s tierstate agent %(process)d: %(message)s"))
    logging.getLogger("tierstate").addHandler(handler)
    logging.getLogger("tierstate").setLevel(logging.INFO)
    config = options.load_config_at(args.config, args.node)
    return run_agent(config)


def _gc(args: argparse.Namespace) -> int:
    older_than = options.duration(args.older_than, "--older-than")
    tiers, buckets = options.split(options.select(options.every_tier(args), args.only, "--only"))
    options.must_exist([p.tier for p in tiers])
    found = collect_garbage([p.tier for p in tiers], older_than, dry_run=args.dry_run)
    found += [f for b in buckets for f in bucket_garbage(b.tier, older_than, args.dry_run)]
    return render.leftovers(found, args.json)


def _export(args: argparse.Namespace) -> int:
    formats = (*get_args(ExportFormat), "dcp")
    fmt = options.choice(args.format, formats, "--format")
    if fmt is None:  # argparse requires it; said here too for a caller that builds the arguments itself
        raise UsageError(f"export needs --format (one of {', '.join(formats)})")
    shard = options.size(args.max_shard_size, "--max-shard-size") if args.max_shard_size else MAX_SHARD_SIZE
    tiers = options.every_tier(args)
    read = [p.tier for p in ([options.pick(tiers, args.source, "--from")] if args.source else tiers)]
    _directories(read)
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
    """A DCP checkpoint committed as step ``--step`` on the tier ``--to``, through a runner; into a
    bucket, committed in a scratch directory first, then uploaded (verified, the manifest last)."""
    from ..integrations.dcp import import_dcp

    target = options.pick(options.every_tier(args), args.target, "--to").tier
    source = Path(args.source)
    if not (source / ".metadata").is_file():
        raise UsageError(f"{source}: not a DCP checkpoint directory (it has no .metadata file)")
    if args.step in target.steps():
        raise UsageError(f"--step {args.step}: tier {target.name} holds a checkpoint step {args.step} already")
    directory, bucket = target.as_directory(), target.as_bucket()
    if directory is not None:
        report = import_dcp(source, target.name, directory.root, args.step, allow_pickle=args.allow_pickle)
    else:
        assert bucket is not None  # a tier is one or the other
        with tempfile.TemporaryDirectory(prefix="tierstate-import-") as scratch:
            report = import_dcp(source, target.name, Path(scratch), args.step, allow_pickle=args.allow_pickle)
            local = FilesystemTier(target.name, Path(scratch))
            manifest = local.manifest(args.step)
            with byte_progress(not args.json)(f"upload step {args.step}", manifest.stored_bytes) as advance:
                sent = bucket.upload(local.step_dir(args.step), manifest, advance)
        report = replace(report, path=sent.target)
    names = ", ".join(f"{name} ({layout})" for name, layout in report.names.items())
    line = f"step {report.step} ({report.tier}): {report.items} items, {render.size(report.bytes)} from {source}"
    line += f": {names}"
    print(json.dumps(report.as_dict(), indent=1) if args.json else line)
    return 0


def _init(args: argparse.Namespace) -> int:
    """Copy a packaged config, comments and all, to DIRECTORY/NAME.yaml for the user to edit."""
    name = args.name.removesuffix(".yaml")
    packaged = packaged_configs()
    if name not in packaged:
        guess = did_you_mean(name, packaged)
        raise UsageError(f"--from {args.name!r}: no such packaged config{guess} (packaged: {', '.join(packaged)})")
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
    "trace": _trace,
    "migrate": _migrate,
    "verify": _verify,
    "prune": _prune,
    "flush": _flush,
    "agent": _agent,
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
