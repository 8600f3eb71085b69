"""Medians, and the interleaved order in which methods take turns."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator


def median(values: Iterable[float]) -> float:
    """The median, or nan for no values (a method that did not run prints as ``-``)."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def interleave(names: list[str], repeats: int) -> Iterator[tuple[int, str]]:
    """A B C A B C ...: every method sees every phase of the machine's background noise."""
    for repeat in range(repeats):
        for name in names:
            yield repeat, name
