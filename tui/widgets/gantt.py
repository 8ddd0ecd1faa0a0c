"""Lifetime (Gantt) chart: one row per tensor or per buffer, bars over slots, a row cursor."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.message import Message
from textual.strip import Strip

from dctms.tui.data import Row
from dctms.tui.widgets.rows import ROW_BINDINGS, RowCursor
from dctms.tui.widgets.timechart import TimeChart, buffer_style, cells_to_strip

_BLANK = Style()


class Gantt(RowCursor, TimeChart):
    """Rows of bars; ``cursor`` is the selected row (posts ``Gantt.Selected`` when it moves)."""

    BINDINGS = [
        *ROW_BINDINGS,
    ]

    class Selected(Message):
        def __init__(self, gantt: Gantt, row: Row | None) -> None:
            super().__init__()
            self.gantt = gantt
            self.row = row

        @property
        def control(self) -> Gantt:
            return self.gantt

    LABEL_WIDTH = 34  # the label column's least width; wider as the labels need, up to:
    MAX_LABEL_WIDTH = 60
    MIN_TIMELINE = 10  # ... and never leaving the bars fewer columns than this

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(0, id=id, classes=classes)
        self.rows: list[Row] = []
        self.cursor = 0
        self.longest_label = 0

    @property
    def label_width(self) -> int:
        """Wide enough for every label (a space either side), so module paths are not cut."""
        wanted = min(max(self.LABEL_WIDTH, self.longest_label + 2), self.MAX_LABEL_WIDTH)
        return min(wanted, max(0, self.size.width - self.MIN_TIMELINE))

    def set_rows(self, rows: list[Row], num_slots: int, keep: str | None = None) -> None:
        """Show ``rows``; the cursor goes to the row keyed ``keep`` when still present, else row 0."""
        self.rows = rows
        self.longest_label = max((len(r.label) for r in rows), default=0)
        self.num_slots = num_slots
        keys = [r.key for r in rows]
        self.cursor = keys.index(keep) if keep in keys else 0
        self.update_virtual_size()
        self.scroll_to(y=max(0, self.cursor - 2), animate=False, immediate=True)
        self.post_message(self.Selected(self, self.selected))

    @property
    def selected(self) -> Row | None:
        return self.rows[self.cursor] if 0 <= self.cursor < len(self.rows) else None

    def content_rows(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------------------ cursor

    def select(self, row: int) -> None:
        if not self.rows:
            return
        row = max(0, min(len(self.rows) - 1, row))
        if row != self.cursor:
            self.cursor = row
            self.refresh()
            self.post_message(self.Selected(self, self.selected))
        visible = max(1, self.scrollable_content_region.height - 1)  # minus the axis line
        if row < self.scroll_y:
            self.scroll_to(y=row, animate=False, immediate=True)
        elif row >= self.scroll_y + visible:
            self.scroll_to(y=row - visible + 1, animate=False, immediate=True)
        bars = self.rows[row].bars
        if bars and not self.fitted:
            self.show_slots(bars[0].start, bars[-1].end)

    def anchor_slot(self) -> int | None:
        selected = self.selected
        return selected.bars[0].start if selected is not None and selected.bars else None

    def select_key(self, key: str) -> bool:
        for i, r in enumerate(self.rows):
            if r.key == key:
                self.select(i)
                return True
        return False

    def on_click(self, event: events.Click) -> None:
        if event.y >= 1:
            self.select(int(self.scroll_y) + event.y - 1)

    # ---------------------------------------------------------------------------- drawing

    def render_axis_label(self, width: int) -> Strip:
        style = self.get_component_rich_style("timechart--axis")
        text = f"{len(self.rows):,} rows"
        return Strip([Segment(f" {text:<{width - 6}}slot ", style)])

    def render_label(self, row: int, width: int) -> Strip:
        style = self.get_component_rich_style("timechart--label")
        if row == self.cursor:
            style += self.get_component_rich_style("timechart--cursor")
        return Strip([Segment(" " + self.rows[row].label[: width - 2], style)])

    def render_row(self, row: int, c0: int, c1: int) -> Strip:
        width = max(0, c1 - c0)
        cells: list[tuple[str, Style]] = [(" ", _BLANK)] * width
        for bar in self.rows[row].bars:
            b0, b1 = self.columns_of(bar.start, bar.end)
            lo, hi = max(b0, c0), min(b1, c1 - 1)
            if lo > hi:
                continue
            style = buffer_style(bar.buffer)
            char = "░" if bar.buffer is None else ("▓" if bar.shade else "█")
            for c in range(lo - c0, hi - c0 + 1):
                cells[c] = (char, style)
        base = self.rich_style
        if row == self.cursor:
            # The cursor's (theme-blended) background; bars keep their buffer colour.
            base = base + Style(bgcolor=self.get_component_rich_style("timechart--cursor").bgcolor)
        return cells_to_strip(cells, base)
