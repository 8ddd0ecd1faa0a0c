"""A virtual table: rows of plain text drawn line by line, only those on screen.

Textual's DataTable measures every cell when rows are added (about a second for the 7B plan's 3,224
ops on this machine), so the long lists (ops, slots) use this instead: column widths come from string
lengths, and each visible line is one Strip.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.cells import cell_len
from rich.segment import Segment
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from dctms.tui.widgets.rows import ROW_BINDINGS, RowCursor

GAP = 2  # spaces between columns
MAX_WIDTH = 72  # default cap on a column's width (details panels show whole values)


@dataclass(frozen=True)
class Column:
    label: str
    key: str
    numeric: bool = False  # right-aligned, sorted as a number
    max_width: int = MAX_WIDTH  # longer cells are clipped with an ellipsis


def sort_key(text: str, numeric: bool) -> tuple[int, float, str]:
    """Numbers (``1,024``, ``-3``) before text; empty cells last in either kind of column."""
    if not text:
        return (2, 0.0, "")
    if numeric:
        try:
            return (0, float(text.replace(",", "")), "")
        except ValueError:
            pass
    return (1, 0.0, text.lower())


def clip(text: str, width: int) -> str:
    if cell_len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "…"


class VirtualTable(RowCursor, ScrollView, can_focus=True):
    """Rows of strings with a sticky header, a row cursor and sort-by-header-click."""

    BINDINGS = [
        *ROW_BINDINGS,
        Binding("left,h", "scroll_columns(-1)", "columns", show=False),
        Binding("right,l", "scroll_columns(1)", "columns", show=False),
    ]

    COMPONENT_CLASSES = {"table--header", "table--cursor", "table--odd"}

    class Highlighted(Message):
        """The cursor moved to row ``index`` (in display order) whose key is ``key``."""

        def __init__(self, table: VirtualTable, index: int, key: str | None) -> None:
            super().__init__()
            self.table = table
            self.index = index
            self.key = key

        @property
        def control(self) -> VirtualTable:
            return self.table

    def __init__(self, columns: list[Column], *, id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes)
        self.columns = columns
        self.rows: list[tuple[str, ...]] = []
        self.keys: list[str] = []
        self.widths = [cell_len(c.label) + 1 for c in columns]  # + 1: room for the sort arrow
        self.cursor = 0
        self.sorted_by: tuple[str, bool] | None = None

    # --------------------------------------------------------------------------------- data

    def set_rows(self, rows: list[tuple[str, ...]], keys: list[str]) -> None:
        """Replace the rows (cells as text; ``keys`` identify them); the cursor goes to row 0."""
        self.rows = rows
        self.keys = keys
        widths = [cell_len(c.label) + 1 for c in self.columns]
        for row in rows:
            for i, cell in enumerate(row):
                if len(cell) > widths[i]:  # len == cells for the ASCII the plans hold; cheap
                    widths[i] = len(cell)
        self.widths = [min(w, c.max_width) for w, c in zip(widths, self.columns, strict=True)]
        self.cursor = 0
        if self.sorted_by is not None:
            self._sort(*self.sorted_by)
        self.virtual_size = Size(sum(self.widths) + GAP * len(self.widths) + 1, len(rows) + 1)
        self.scroll_to(0, 0, animate=False, immediate=True)
        self.refresh()
        self.post_message(self.Highlighted(self, 0, self.selected_key))

    @property
    def selected_key(self) -> str | None:
        return self.keys[self.cursor] if 0 <= self.cursor < len(self.keys) else None

    @property
    def row_count(self) -> int:
        return len(self.rows)

    def sort_by(self, key: str, reverse: bool = False) -> None:
        """Sort by column ``key``; the cursor stays on the same row."""
        keep = self.selected_key
        self._sort(key, reverse)
        self.sorted_by = (key, reverse)
        self.cursor = self.keys.index(keep) if keep in self.keys else 0
        self.refresh()
        self.select(self.cursor, force=True)

    def _sort(self, key: str, reverse: bool) -> None:
        column = next(i for i, c in enumerate(self.columns) if c.key == key)
        numeric = self.columns[column].numeric
        order = sorted(
            range(len(self.rows)),
            key=lambda i: sort_key(self.rows[i][column], numeric),
            reverse=reverse,
        )
        self.rows = [self.rows[i] for i in order]
        self.keys = [self.keys[i] for i in order]

    # ------------------------------------------------------------------------------- cursor

    def select(self, index: int, *, force: bool = False) -> None:
        if not self.rows:
            return
        index = max(0, min(len(self.rows) - 1, index))
        if index != self.cursor or force:
            self.cursor = index
            self.refresh()
            self.post_message(self.Highlighted(self, index, self.selected_key))
        visible = max(1, self.scrollable_content_region.height - 1)
        if index < self.scroll_y:
            self.scroll_to(y=index, animate=False, immediate=True)
        elif index >= self.scroll_y + visible:
            self.scroll_to(y=index - visible + 1, animate=False, immediate=True)

    def select_key(self, key: str) -> bool:
        if key in self.keys:
            self.select(self.keys.index(key), force=True)
            return True
        return False

    def action_scroll_columns(self, direction: int) -> None:
        step = max(4, self.scrollable_content_region.width // 4)
        self.scroll_to(x=self.scroll_x + direction * step, animate=False, immediate=True)

    def on_click(self, event: events.Click) -> None:
        if event.y == 0:
            x = event.x + int(self.scroll_x)
            edge = 0
            for column, width in zip(self.columns, self.widths, strict=True):
                edge += width + GAP
                if x < edge:
                    reverse = self.sorted_by == (column.key, False)
                    self.sort_by(column.key, reverse)
                    return
        else:
            self.select(int(self.scroll_y) + event.y - 1)

    # ------------------------------------------------------------------------------ drawing

    def _line(self, cells: tuple[str, ...] | list[str]) -> str:
        parts = []
        for column, width, cell in zip(self.columns, self.widths, cells, strict=False):
            text = clip(cell, width)
            pad = " " * (width - cell_len(text))
            parts.append(pad + text if column.numeric else text + pad)
        return " " + (" " * GAP).join(parts)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        x = int(self.scroll_x)
        if y == 0:
            labels = [c.label for c in self.columns]
            if self.sorted_by is not None:
                labels = [
                    c.label
                    + (("▼" if self.sorted_by[1] else "▲") if c.key == self.sorted_by[0] else "")
                    for c in self.columns
                ]
            style = self.get_component_rich_style("table--header")
            text, line_style = self._line(labels), style
        else:
            row = int(self.scroll_y) + y - 1
            if row >= len(self.rows):
                return Strip.blank(width, self.rich_style)
            text = self._line(self.rows[row])
            # Non-partial component styles: their translucent backgrounds come blended.
            if row == self.cursor:
                line_style = self.get_component_rich_style("table--cursor")
            elif row % 2:
                line_style = self.get_component_rich_style("table--odd")
            else:
                line_style = self.rich_style
        strip = Strip([Segment(text, line_style)])
        return strip.crop_extend(x, x + width, line_style)
