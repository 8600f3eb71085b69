"""The tables: printed with rich, and written with the machine's facts to ``benchmarks/results/``
(raw numbers as ``<name>.json``, the tables as printed as ``<name>.md``) for RESULTS.md."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .machine import load_average
from .paths import RESULTS_DIR


def progress(text: str) -> None:
    """One line of progress on stderr, so stdout holds only the tables."""
    print(text, file=sys.stderr, flush=True)


@dataclass
class Report:
    """A titled table printed with rich and saved (with the machine facts) as JSON for RESULTS.md."""

    name: str
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    def add(self, *cells: object) -> None:
        self.rows.append([c if isinstance(c, str) else f"{c}" for c in cells])

    def note(self, text: str) -> None:
        self.notes.append(text)

    def note_each(self, texts: Mapping[str, str]) -> None:
        """A note ``label: text`` for every non-empty text (how each method was set up)."""
        for label, text in texts.items():
            if text:
                self.note(f"{label}: {text}")

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=self.title, title_justify="left")
        for i, column in enumerate(self.columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in self.rows:
            table.add_row(*row)
        console = Console(highlight=False, width=max(150, shutil.get_terminal_size().columns))
        console.print(table)
        for text in self.notes:
            console.print(f"  {text}", soft_wrap=True)

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "|".join(["---"] + ["---:"] * (len(self.columns) - 1)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        lines += [""] + [f"- {text}" for text in self.notes]
        return "\n".join(lines) + "\n"


def command_line(script: str, argv: list[str] | None) -> str:
    """How the results were made: ``python benchmarks/<script>.py`` and its arguments (``argv``; None =
    this process's)."""
    return "python " + " ".join([f"benchmarks/{script}.py", *(sys.argv[1:] if argv is None else argv)])


def markdown_document(command: str, facts: Mapping[str, str], reports: list[Report]) -> str:
    """The ``.md`` of a run: the command, the machine's facts, then every table."""
    return "\n".join([f"`{command}`", "", *(f"- {k}: {v}" for k, v in facts.items()), ""]
                     + [r.markdown() for r in reports])


def publish(
    script: str,
    reports: list[Report],
    facts: Mapping[str, str],
    argv: list[str] | None,
    directory: Path | None = None,
    tag: str = "",
) -> Path:
    """Print every table, then write ``<directory>/<script>[-<tag>].json`` (raw numbers) and ``.md`` (the
    tables as printed), headed by the command that made them; returns the JSON's path. ``directory``
    None: ``benchmarks/results``."""
    for report in reports:
        report.print()
    directory = directory or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{script}-{tag}" if tag else script
    facts = {**facts, "load_avg_end": f"{load_average():.2f}"}
    command = command_line(script, argv)
    payload = {"command": command, "machine": facts, "reports": [vars(r) for r in reports]}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    (directory / f"{name}.md").write_text(markdown_document(command, facts, reports))
    progress(f"raw numbers: {path}")
    return path
