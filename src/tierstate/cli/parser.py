"""The ``tierstate`` command line's options and help.

Parsing needs nothing but argparse, so ``--help`` and ``--version`` answer at once; the code that
reads checkpoints (cli/run.py, which loads torch, seconds) is imported only to run a command.
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn

from .._version import __version__
from ..pipeline.packaged import packaged_configs
from . import s3

_INVALID_COMMAND = re.compile(r"^argument COMMAND: invalid choice: '([^']*)'")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, which says which command a mistyped one is probably meant to be."""

    commands: list[str] = []

    def error(self, message: str) -> NoReturn:
        typed = _INVALID_COMMAND.match(message)
        if typed is not None:
            close = difflib.get_close_matches(typed.group(1), self.commands, n=1)
            guess = f"; did you mean {close[0]!r}?" if close else ""
            message = f"no command {typed.group(1)!r}{guess} (commands: {', '.join(self.commands)})"
        super().error(message)


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number")
    return int(text)


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    packaged = ", ".join(packaged_configs())
    parser = _Parser(
        prog="tierstate",
        description="Checkpoints across tiers: list, move, check. Tiers come from --config (a pipeline YAML "
        f"or a packaged config by name: {packaged}) or --tier NAME=PATH.",
    )
    parser.add_argument("--version", action="version", version=f"tierstate {__version__}")
    common = _Parser(add_help=False)
    common.add_argument(
        "--config", metavar="YAML", help="pipeline YAML (or packaged config name) whose tiers and policies to use"
    )
    common.add_argument(
        "--tier", action="append", metavar="NAME=PATH", help="a tier directory, or s3://bucket/prefix (repeatable)"
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of tables and lines")
    common.add_argument(
        "--endpoint-url", metavar="URL", help="the S3 server of s3:// tiers, if not AWS's (default: $AWS_ENDPOINT_URL)"
    )
    common.add_argument("--region", help="the region of s3:// tiers (default: the AWS configuration's)")
    common.add_argument(
        "--node",
        metavar="NAME",
        help="read node-scoped tiers as node NAME sees them: {node} in a tier path is NAME "
        "(default: $TIERSTATE_NODE, else the hostname)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str, parents: list[_Parser]) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=parents, help=text, description=text)

    def only(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--only", action="append", metavar="TIER", help="work on this tier only (repeatable)")

    command("ls", "list checkpoints on every tier", [common])
    i = command("inspect", "show a checkpoint's manifest as a table", [common])
    i.add_argument("target", help="a checkpoint directory, or a step number found on the tiers")

    s = command("stats", "what a checkpoint cost: bytes, seconds, GB/s per stage", [common])
    s.add_argument("target", help="a checkpoint directory, or a step number found on the tiers")
    s.add_argument("--trace", metavar="FILE", help="also write its timeline as a Chrome/Perfetto trace (JSON)")

    m = command("migrate", "copy (or --move) committed checkpoints to another tier, verified", [common])
    m.add_argument("step", nargs="?", type=_step, help="the step to migrate (or --all)")
    m.add_argument("--all", action="store_true", help="every committed step of the --from tier")
    m.add_argument("--from", dest="source", required=True, metavar="TIER", help="tier to copy from")
    m.add_argument("--to", dest="target", required=True, metavar="TIER", help="tier to copy to")
    m.add_argument("--move", action="store_true", help="delete the source copy once the target's is published")
    m.add_argument("--format", help="rewrite in this container format: frames or hdf5 (default: keep it)")
    m.add_argument("--bandwidth", metavar="SIZE", help="bytes per second to use at most, e.g. 200MB")

    v = command("verify", "recompute every checksum; exit 1 naming file and frame of any mismatch", [common])
    v.add_argument("steps", nargs="*", type=_step, metavar="STEP", help="steps to verify (default: all)")
    only(v)

    p = command("prune", "delete the checkpoints retention does not keep (asks first on a terminal)", [common])
    p.add_argument("--keep-last", type=_at_least_one, metavar="N", help="keep the N newest steps (overrides the YAML)")
    p.add_argument("--keep-every", type=_at_least_one, metavar="K", help="keep steps that are multiples of K")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted and freed, delete nothing")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask before deleting")
    only(p)

    f = command(
        "flush", "copy committed checkpoints due on a later tier (flush.every) and not there, as a restarted "
        "runner does (e.g. after a crashed job), oldest first and verified; then apply retention", [common],
    )  # fmt: skip
    f.add_argument("--bandwidth", metavar="SIZE", help="bytes per second to use at most, e.g. 200MB")

    s3.add_parser(sub)

    g = command("gc", "remove .partial leftovers older than a bound, and .deleting ones", [common])
    g.add_argument("--older-than", default="1h", metavar="AGE", help="e.g. 30m, 2h, 1d (default 1h)")
    g.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    only(g)

    e = command(
        "export", "write one checkpoint as an HDF5 or safetensors file, Hugging Face weights or a DCP directory",
        [common],
    )
    e.add_argument("step", type=_step, help="the step to export")
    e.add_argument("out", help="the file to write (hf, dcp: the directory)")
    e.add_argument(
        "--format", required=True,
        help="hdf5, safetensors, hf (a Hugging Face model directory) or dcp (torch.distributed.checkpoint)",
    )  # fmt: skip
    e.add_argument("--provider", metavar="NAME", help="export this provider's items only, named without NAME/")
    e.add_argument("--max-shard-size", metavar="SIZE", help="hf: the largest weights file, e.g. 5GB (default 50GB)")
    e.add_argument("--from", dest="source", metavar="TIER", help="read this tier's copy (default: fastest good one)")
    e.add_argument("--force", action="store_true", help="replace the file if it exists")

    t = command("import", "commit a torch.distributed.checkpoint (DCP) directory as a checkpoint on a tier", [common])
    t.add_argument("source", help="the DCP checkpoint directory (it holds .metadata)")
    t.add_argument("--to", dest="target", required=True, metavar="TIER", help="the tier to commit it on")
    t.add_argument("--step", required=True, type=_step, help="the step number to give it")
    t.add_argument("--allow-pickle", action="store_true", help="load and store objects that need pickle (trusted data)")

    n = command("init", "write an editable copy of a packaged config", [])
    n.add_argument("directory", nargs="?", default=".", help="where to write NAME.yaml (default: here)")
    n.add_argument(
        "--from", dest="name", default="default", metavar="NAME", help=f"a packaged config: {packaged}"
    )
    n.add_argument("--force", action="store_true", help="replace the file if it exists")
    parser.commands = list(sub.choices)
    return parser
