"""Progress for long work: rich bars with bytes and GB/s on a terminal, nothing when piped or --json.

Bars go to stderr, so stdout carries only the results (plain lines or JSON) even on a terminal.
Workers report bytes done through a plain callable, so the tiers code knows nothing of rich.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

Advance = Callable[[int], None]


def _ignore(_nbytes: int) -> None:
    return None


@contextmanager
def byte_progress(enabled: bool, description: str, total: int) -> Iterator[Advance]:
    """A callable to report bytes done; draws a bar only if ``enabled`` and stderr is a terminal."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield _ignore
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(description, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)
