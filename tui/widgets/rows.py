"""Cursor movement shared by the row-based widgets (the Gantt chart and the virtual table)."""

from __future__ import annotations

from textual.binding import Binding

# Keys of every row widget; widgets add their own after these.
ROW_BINDINGS = [
    Binding("up,k", "move(-1)", "row", key_display="↑↓/jk"),
    Binding("down,j", "move(1)", "down", show=False),
    Binding("pageup", "page(-1)", "page up", show=False),
    Binding("pagedown", "page(1)", "page down", show=False),
    Binding("home", "first", "first", show=False),
    Binding("end", "last", "last", show=False),
]


class RowCursor:
    """Key actions over ``self.rows`` for a widget with ``select(index)`` and ``cursor``."""

    def action_move(self, step: int) -> None:
        self.select(self.cursor + step)

    def action_page(self, direction: int) -> None:
        self.select(self.cursor + direction * max(1, self.scrollable_content_region.height - 2))

    def action_first(self) -> None:
        self.select(0)

    def action_last(self) -> None:
        self.select(len(self.rows) - 1)
