"""Tables of results: drawn on a terminal without breaking a word that fits, plain columns otherwise.

On a terminal the columns are sized here, not by rich, because rich narrows columns evenly when a
table is too wide and so folds short words (``commit`` / ``ted``). Here a column is never narrower
than its longest word, and what is left goes to the columns whose cells hold several words. Only a
word longer than the terminal itself (a long tensor key) is folded, in any layout. Where the
terminal is too narrow for such a table, each row is shown as ``column: value`` lines. Piped or
redirected, rows are plain padded lines, whole, for grep and awk. Nothing is ever cut, and cells are
shown as written (never read as rich markup: a key ``w[bold]`` or a path ``[/x]`` is text).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

# Each column costs a border and a space either side; the table one border more.
_BORDER, _PADDING = 1, 2
# A column whose words are longer than the terminal is folded within them, given at least this much room.
_FOLDED_MIN = 12


def columns(names: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[str] = ()) -> list[str]:
    """Rows in padded columns (those named in ``right`` right-aligned), each row whole on its line."""
    widths = [max(len(cell) for cell in cells) for cells in zip(names, *rows, strict=True)]
    lines = []
    for row in (names, *rows):
        cells = (c.rjust(w) if name in right else c.ljust(w) for c, w, name in zip(row, widths, names, strict=True))
        lines.append("  ".join(cells).rstrip())
    return lines


def table(title: str | None, names: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[str] = ()) -> None:
    """A table on stdout: drawn on a terminal, plain padded columns otherwise."""
    console = Console()
    if not console.is_terminal:
        print("\n".join(([title] if title else []) + columns(names, rows, right)))
        return
    widths = column_widths(names, rows, console.width)
    if widths is None:  # too narrow for a table: each row as lines of `column: value`
        if title:
            console.print(Text(title))
        for index, row in enumerate(rows):
            if index or title:
                console.print()
            for name, cell in zip(names, row, strict=True):
                console.print(Text(f"{name}: {cell}"), overflow="fold")
        return
    drawn = Table(title=Text(title) if title else None)
    for name, width in zip(names, widths, strict=True):
        drawn.add_column(name, justify="right" if name in right else "left", overflow="fold", width=width)
    for row in rows:
        drawn.add_row(*map(Text, row))  # as written: a key or path with [brackets] is no rich markup
    console.print(drawn)


def column_widths(names: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[int] | None:
    """Each column's width in a table ``width`` characters wide, borders included; None where no table
    fits that shows every word whole but those longer than the terminal itself (folded in any layout)."""
    cells = list(zip(names, *rows, strict=True))
    natural = [max(len(cell) for cell in column) for column in cells]
    words = [max((len(word) for cell in column for word in cell.split()), default=1) for column in cells]
    room = width - _BORDER - len(names) * (_BORDER + _PADDING)
    if sum(natural) <= room:
        return natural
    longest = width - 2 * _BORDER - _PADDING  # the widest cell a terminal this wide can show at all
    widths = [_FOLDED_MIN if word > longest else word for word in words]
    if sum(widths) > room:
        return None
    # What is left goes, a character at a time, to the columns still narrower than their cells.
    spare = room - sum(widths)
    while spare > 0 and any(widths[i] < natural[i] for i in range(len(names))):
        for i in range(len(names)):
            if spare and widths[i] < natural[i]:
                widths[i] += 1
                spare -= 1
    return widths
