"""Rich tables that fit where they are printed: an 80-column terminal, a pipe, a report.

A table too wide for its console is shrunk by Rich, which wraps cells at spaces and then
cuts what still does not fit to "…": policy names and figures alike. So every CLI table
with many columns is offered here in layouts, from the fullest to the narrowest, and the
first that Rich draws without cutting a cell is the one printed. The choice is made when
the table is rendered, so the same object fits a terminal, a pipe (80 columns) and the
demo's 140-column HTML report; the figures a narrow layout leaves out are in ``--json``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement

__all__ = ["Fitted", "in_chunks"]

_CUT = "…"  # what Rich puts where it cut a cell
_Item = TypeVar("_Item")


class Fitted:
    """The first of ``layouts`` that renders at the console's width with no cell cut to
    "…" (the last one when none does)."""

    def __init__(self, *layouts: RenderableType) -> None:
        if not layouts:
            raise ValueError("Fitted needs at least one layout")
        self.layouts = layouts

    def chosen(self, console: Console, options: ConsoleOptions) -> RenderableType:
        """The layout drawn with ``options``."""
        for layout in self.layouts[:-1]:
            lines = console.render_lines(layout, options, pad=False)
            if not any(_CUT in segment.text for line in lines for segment in line):
                return layout
        return self.layouts[-1]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.chosen(console, options)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.chosen(console, options))


def in_chunks(items: Sequence[_Item], table: Callable[[Sequence[_Item]], RenderableType]) -> Fitted:
    """``table(items)`` side by side, or, where that does not fit, the items split into
    consecutive groups of as many as fit, one ``table`` each, one below the other."""
    layouts: list[RenderableType] = [table(items)]
    for size in range(len(items) - 1, 0, -1):
        groups = [items[i : i + size] for i in range(0, len(items), size)]
        layouts.append(Group(*(table(group) for group in groups)))
    return Fitted(*layouts)
