"""Tables that stay readable at any width, 80 columns and CI logs included.

Left to itself, rich squeezes a table that is too wide by cutting the widest columns
evenly: a kernel's name becomes `02_coales…` and a number `2,…`. `Fitted(view)` renders
VIEW with each of its tables laid out for the width it is given instead:

- a table that fits is left alone;
- one that fits once its text wraps (at spaces, never inside a word or a number, and
  not inside a short cell such as `274 ms`) gets narrower columns, the widest narrowed
  first, none below what it needs to stay whole;
- one that cannot fit even so (a dozen columns in 80) becomes one record per row: the
  first cell as a heading, then `header value` pairs that wrap as text.

Rows keep their cells, styles and order; nothing is abbreviated.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text


class Fitted:
    """VIEW, with its tables (also inside a Group) laid out for the width it renders at."""

    def __init__(self, view: RenderableType):
        self.view = view

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield fit(self.view, console, options)


def fit(view: RenderableType, console: Console, options: ConsoleOptions) -> RenderableType:
    if isinstance(view, Table):
        return fit_table(view, console, options)
    if isinstance(view, Group):
        return Group(*(fit(part, console, options) for part in view.renderables))
    return view


def fit_table(table: Table, console: Console, options: ConsoleOptions) -> RenderableType:
    """TABLE as it is, with widths that wrap text only at spaces, or as records (see the module)."""
    if not table.columns:
        return table
    try:
        available = options.max_width - table._extra_width
        paddings = [table._get_padding_width(column._index) for column in table.columns]
    except AttributeError:  # a rich whose tables differ inside: leave the table to rich
        return table
    measured = [measure_column(column, console) for column in table.columns]
    smallest = [small + pad for (small, _), pad in zip(measured, paddings)]
    largest = [big + pad for (_, big), pad in zip(measured, paddings)]
    if sum(largest) <= available:
        return table
    if sum(smallest) > available:
        return as_records(table, console)
    widths = list(largest)
    for _ in range(sum(largest) - available):  # one character at a time off the widest that can give it
        widest = max((i for i in range(len(widths)) if widths[i] > smallest[i]), key=lambda i: widths[i])
        widths[widest] -= 1
    fitted = copy.copy(table)
    fitted.columns = [replace(column, width=max(1, width - pad), min_width=None, max_width=None)
                      for column, width, pad in zip(table.columns, widths, paddings)]
    return fitted


SHORT = 12  # a cell this wide or narrower (a number and its unit) is not wrapped


def measure_column(column, console: Console) -> tuple[int, int]:
    """(narrowest, widest) that COLUMN's text can take: the header may wrap at any space, a
    cell only if it is longer than SHORT."""

    def lines(cell) -> list[str]:
        return _text(cell, console).plain.splitlines() or [""]

    def words(line: str) -> int:
        return max((len(word) for word in line.split()), default=0)

    header = lines(column.header)
    narrowest = max(words(line) for line in header)
    widest = max(len(line) for line in header)
    for cell in column.cells:
        for line in lines(cell):
            narrowest = max(narrowest, len(line) if len(line) <= SHORT else words(line))
            widest = max(widest, len(line))
    return max(narrowest, 1), max(widest, narrowest, 1)


def _text(cell, console: Console) -> Text:
    if isinstance(cell, Text):
        return cell.copy()
    if isinstance(cell, str):
        return console.render_str(cell)
    return Text(str(cell))


def as_records(table: Table, console: Console) -> Group:
    """Each row of TABLE as a heading (its first cell) and `header value` pairs, · between them."""

    def text(cell) -> Text:
        return _text(cell, console)

    headers = [text(column.header).plain.replace("\n", " ").strip() for column in table.columns]
    cells = [list(column.cells) for column in table.columns]
    parts: list[RenderableType] = []
    if table.title:
        parts.append(text(table.title))
    last_heading = None
    for index in range(table.row_count):
        row = [column_cells[index] if index < len(column_cells) else "" for column_cells in cells]
        style = table.rows[index].style if index < len(table.rows) else None
        heading = text(row[0])
        if heading.plain.strip() and heading.plain != last_heading:  # rows of one shape: its name once
            last_heading = heading.plain
            heading.stylize("bold")
            parts.append(heading)
        pairs = Text(style=style or "")
        for header, cell in zip(headers[1:], row[1:]):
            value = text(cell)
            if not value.plain.strip():
                continue
            if pairs.plain:
                pairs.append(" · ", style="dim")
            pairs.append(f"{header} ", style="dim")
            pairs.append(value)
        if pairs.plain:
            parts.append(Padding(pairs, (0, 0, 0, 2)))
    if table.caption:
        parts.append(text(table.caption))
    return Group(*parts)
