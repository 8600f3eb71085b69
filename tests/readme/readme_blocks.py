"""README.md as the tests see it: its fenced blocks, the scenario each belongs to, console commands with
the output they show, and a tolerant comparison of shown and real output.

A block belongs to the scenario named by the marker on the line before its fence,
``<!-- readme-test: NAME -->`` or ``<!-- readme-test: NAME; stand-ins: what the test gives it -->``;
blocks with the same NAME run in one working directory, in README order (a console block that exports,
then the Python block that reads the export). Blocks without a marker run on their own in an empty
directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!-- readme-test: ([\w-]+)(?:;.*?)? -->\s*\Z")


@dataclass(frozen=True)
class Block:
    line: int  # the line of its opening fence in README.md
    language: str  # "" for a fence without one
    text: str
    scenario: str | None  # the marker's name, None without one

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README (or of ``text``), in order."""
    text = README.read_text(encoding="utf-8") if text is None else text
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        marker = MARKER.search(before.rstrip("\n").rsplit("\n", 1)[-1] + "\n")
        found.append(Block(before.count("\n") + 1, match.group(1), match.group(2), marker and marker.group(1)))
    return found


@dataclass
class Command:
    line: int
    text: str  # as written after "$ ", comments included (bash drops them)
    shown: list[str]  # the output lines the README shows after it, comments after two spaces dropped
    status: int = 0  # the exit status it must end with: 0 unless the README shows another (below)


SHOWN_COMMENT = re.compile(r"\s{2,}#.*$")


def console_commands(block: Block) -> list[Command]:
    """The ``$ `` lines of a console block, each with the output shown under it. A command followed
    by ``$ echo $?`` is expected to exit with the status that line shows."""
    commands: list[Command] = []
    for offset, raw in enumerate(block.text.splitlines()):
        if raw.startswith("$ "):
            commands.append(Command(block.line + 1 + offset, raw[2:], []))
        elif commands:
            commands[-1].shown.append(SHOWN_COMMENT.sub("", raw).rstrip())
        elif raw.strip():
            raise AssertionError(f"{block.where}: a console block starts with a '$ ' command, not {raw!r}")
    for command, after in zip(commands, [*commands[1:], None], strict=True):
        if command.shown[:1] == ["Killed"]:  # bash's word for a child killed by SIGKILL: 128 + 9
            command.status, command.shown = 137, []
        elif after is not None and after.text.split("#")[0].strip() == "echo $?":
            command.status = int(after.shown[0])
    return commands


def bash_commands(block: Block) -> list[Command]:
    """A bash block's lines, each a command (comments and blank lines skipped); it shows no output."""
    found = []
    for offset, raw in enumerate(block.text.splitlines()):
        if raw.strip() and not raw.lstrip().startswith("#"):
            found.append(Command(block.line + 1 + offset, raw.strip(), []))
    return found


# What may differ between a run and the README: times and dates, checksums, sizes and rates, numbers.
_VARIABLE = [
    (re.compile(r"\d{4}-\d\d-\d\dT[\d:.]+(?:[+-]\d\d:\d\d|Z)?"), "<time>"),
    (re.compile(r"\b[0-9a-f]{16}\b"), "<hash>"),
    (re.compile(r"\d[\d,]*(?:\.\d+)?\s?(?:[kKMGT]i?B|B|bytes?)(?:/s)?\b"), "<size>"),
    (re.compile(r"\d[\d,]*(?:\.\d+)?"), "<n>"),
    (re.compile(r"\s+"), " "),
]


def shape(line: str) -> str:
    """A line with what may differ between runs replaced by placeholders and runs of blanks made one
    (tables pad their columns to the widest value)."""
    for pattern, placeholder in _VARIABLE:
        line = pattern.sub(placeholder, line)
    return line.strip()


def mismatch(shown: list[str], printed: list[str]) -> str | None:
    """None when ``printed`` has the shape of ``shown``, line for line; else what differs."""
    want = [shape(line) for line in shown if line.strip()]
    got = [shape(line) for line in printed if line.strip()]
    if want == got:
        return None
    diff = [f"  shown:   {w!r}\n  printed: {g!r}" for w, g in zip(want, got, strict=False) if w != g][:3]
    if len(want) != len(got):
        diff.append(f"  {len(want)} lines shown, {len(got)} printed")
    return "\n".join(diff)
