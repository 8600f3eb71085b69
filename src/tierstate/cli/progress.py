"""Progress for long work: rich bars with bytes and MB/s on a terminal, nothing when piped or --json.

Bars go to stderr, so stdout carries only the results (plain lines or JSON) even on a terminal. A
result line printed while a bar is drawn (``flush`` and ``migrate --all`` print each step's as it
ends) goes above the bar when stdout is that terminal too; when stdout is a pipe it goes there as it
is, never into the bar's stream. Sizes are rich's decimal units, as the result lines write them
(cli/render.py). The commands report bytes done through a plain callable, so tiers/ knows nothing of
rich.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.progress import Progress as Bars

from .commands import Advance, Progress, no_progress


@contextmanager
def _bar(console: Console, description: str, total: int) -> Iterator[Advance]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Bars(*columns, console=console, redirect_stdout=sys.stdout.isatty(), redirect_stderr=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)


def byte_progress(enabled: bool) -> Progress:
    """The commands' ``progress``: a bar per piece of work if ``enabled`` and stderr is a terminal."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        return no_progress
    return lambda description, total: _bar(console, description, total)
