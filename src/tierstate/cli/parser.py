"""The ``tierstate`` command line's options and help.

Parsing needs nothing but argparse, so ``--help`` and ``--version`` answer at once; the code that
reads checkpoints (cli/run.py, which loads torch, seconds) is imported only to run a command.

People type command lines the way other tools taught them, so: a mistyped command, s3 action or
option is answered with the one probably meant; the options every command takes (``--config``,
``--tier``, ``--json``, ...) are understood before the command too (``tierstate --config tiered ls``,
as git and docker take theirs); a bare ``tierstate`` prints the full help (cli/__init__.py).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .._version import __version__
from ..pipeline.packaged import packaged_configs
from ..suggest import closest, did_you_mean
from . import s3

# argparse's words for a choice it does not know: "argument COMMAND: invalid choice: 'lss' (choose from 'ls', ...)".
_INVALID_CHOICE = re.compile(r"^argument (COMMAND|ACTION): invalid choice: '([^']*)' \(choose from (.*)\)$")
_CHOOSING = {"COMMAND": "command", "ACTION": "s3 action"}

# The options of every command that reads tiers, by dest; given before the command they are kept under
# BEFORE + dest, then handed to it (global_options).
COMMON = ("config", "tier", "json", "endpoint_url", "region", "node")
BEFORE = "before_"

EXAMPLES = """\
examples:
  tierstate ls --config tiered                       the checkpoints on a packaged config's tiers
  tierstate ls --tier nvme=/local/ckpt               ... or on directories (and s3://bucket/prefix)
  tierstate verify 400 --config my.yaml              every checksum of step 400, on every tier
  tierstate migrate 400 --from nvme --to pfs --config tiered
  tierstate flush --config cluster                   the copies a crashed job left due, by hand
  tierstate trace 400 --config tiered                its timeline, for ui.perfetto.dev
  tierstate init                                     an editable copy of the default config
  tierstate COMMAND --help                           a command's own options
"""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, which guesses what a mistyped command, s3 action or option meant, and remembers
    its options and its subcommands for that."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # argparse's own keywords
        self.chooser: argparse.Action | None = None  # its subcommands (COMMAND, ACTION), if it has any
        super().__init__(*args, **kwargs)

    @property
    def option_names(self) -> list[str]:
        """Its long options, its parents' (the common options) included."""
        return [name for name in self._option_string_actions if name.startswith("--")]

    def add_subparsers(self, **kwargs: Any) -> Any:  # argparse's private subparsers type
        self.chooser = super().add_subparsers(**kwargs)
        return self.chooser

    def chosen(self, args: argparse.Namespace) -> _Parser:
        """The parser of the (sub)command ``args`` ran: this one, or a subcommand's, innermost."""
        if self.chooser is None or not isinstance(self.chooser.choices, dict):
            return self
        child = self.chooser.choices.get(getattr(args, self.chooser.dest, None))
        return child.chosen(args) if isinstance(child, _Parser) else self

    def error(self, message: str) -> NoReturn:
        typed = _INVALID_CHOICE.match(message)
        if typed is not None:
            what, word = _CHOOSING[typed.group(1)], typed.group(2)
            choices = [choice.strip().strip("'") for choice in typed.group(3).split(",")]
            message = f"no {what} {word!r}{did_you_mean(word, choices)} ({what}s: {', '.join(choices)})"
        super().error(message)

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """Refuse what this parser does not take, guessing the option meant by each mistyped one."""
        typed = [word.partition("=")[0] for word in extras if word.startswith("--")]
        guesses = {word: meant for word in typed if (meant := closest(word, self.option_names)) is not None}
        message = f"unrecognized arguments: {' '.join(extras)}"
        if len(guesses) == 1:
            message += f"; did you mean {next(iter(guesses.values()))!r}?"
        elif guesses:
            message += f"; did you mean {', '.join(f'{meant!r} (not {word})' for word, meant in guesses.items())}?"
        self.error(message)


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number")
    return int(text)


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _common_options(add: Callable[..., object], prefix: str = "") -> None:
    """The options of every command that reads tiers, through ``add`` (a parser's or a group's ``add_argument``;
    ``prefix``: kept apart, as given before the command)."""
    add("--config", dest=prefix + "config", metavar="YAML",
        help="pipeline YAML (or packaged config name) whose tiers and policies to use")  # fmt: skip
    add("--tier", dest=prefix + "tier", action="append", metavar="NAME=PATH",
        help="a tier directory, or s3://bucket/prefix (repeatable)")  # fmt: skip
    add("--json", dest=prefix + "json", action="store_true", help="print JSON, not tables and lines")
    add("--endpoint-url", dest=prefix + "endpoint_url", metavar="URL",
        help="the S3 server of s3:// tiers, if not AWS's (default: $AWS_ENDPOINT_URL)")  # fmt: skip
    add("--region", dest=prefix + "region", metavar="REGION", help="the region of s3:// tiers (default: AWS's config)")
    add("--node", dest=prefix + "node", metavar="NAME",
        help="read node-scoped tiers as node NAME sees them: {node} in a tier path is NAME "
        "(default: $TIERSTATE_NODE, else the hostname)")  # fmt: skip


def build_parser() -> _Parser:
    packaged = ", ".join(packaged_configs())
    parser = _Parser(
        prog="tierstate",
        description="Checkpoints across tiers: list, move, check.\n"
        f"Tiers come from --config (a pipeline YAML or a packaged config by name: {packaged})\n"
        "or --tier NAME=PATH.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tierstate {__version__}")
    _common_options(parser.add_argument_group("options of every command, also taken before it").add_argument, BEFORE)
    common = _Parser(add_help=False)
    _common_options(common.add_argument)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

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

    r = command(
        "trace", "write a checkpoint's timeline (each stage's work on each chunk, on which thread; the trainer's "
        "blocked time) as a Chrome/Perfetto trace, for ui.perfetto.dev or chrome://tracing", [common],
    )  # fmt: skip
    r.add_argument("target", help="a checkpoint directory, or a step number found on the tiers")
    r.add_argument("-o", "--output", metavar="FILE", help="where to write it (default: trace-step-N.json)")

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

    command(
        "agent", "the node agent: flush the persist tier's checkpoints on along the flush graph and apply retention, "
        "in this process, until no trainer is attached and nothing is left (a runner with agent.enabled starts it; "
        "a launcher may start it itself with the runner's --config)", [common],
    )  # fmt: skip

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
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed: a command and its options, the common options given before it handed to it."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    chosen = parser.chosen(args)
    if args.command is None:
        parser.error("give a COMMAND (tierstate --help lists them)")
    if extras:
        chosen.unrecognized(extras)
    for dest in COMMON:
        before = vars(args).pop(BEFORE + dest)
        if before is None or before is False:
            continue
        if dest not in vars(args):
            chosen.error(f"{'--' + dest.replace('_', '-')} is not an option of {chosen.prog}")
        if dest == "tier":
            args.tier = [*before, *(args.tier or [])]
        elif getattr(args, dest) in (None, False):  # given after the command too: that one counts
            setattr(args, dest, before)
    return args
