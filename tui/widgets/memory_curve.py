"""Live bytes over schedule time for one phase, with the peak and the arena / lower-bound lines."""

from __future__ import annotations

import math

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.strip import Strip

from dctms.figures.units import human
from dctms.tui.widgets.timechart import TimeChart, cells_to_strip

_BLOCKS = " ▁▂▃▄▅▆▇█"
_FILL = Style(color="#61afef")
_PEAK = Style(color="#e06c75", bold=True)
_ARENA = Style(color="#e5c07b")
_BOUND = Style(color="#98c379")
_NONE = Style()


class MemoryCurve(TimeChart):
    """Bars of live bytes per column (the maximum over the slots a column covers when zoomed out).

    ``slot`` is the inspected slot (the peak at first): ``[``/``]`` step it, ``m`` jumps back to the
    peak, a click picks the highest slot under the mouse; ``SlotChosen`` tells the screen.
    """

    BINDINGS = [
        Binding("left_square_bracket", "step(-1)", "slot", key_display="[ ]"),
        Binding("right_square_bracket", "step(1)", "next slot", show=False),
        Binding("m", "peak", "peak"),
    ]

    LABEL_WIDTH = 12

    class SlotChosen(Message):
        def __init__(self, chart: MemoryCurve, slot: int) -> None:
            super().__init__()
            self.chart = chart
            self.slot = slot

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(0, id=id, classes=classes)
        self.curve: list[int] = []
        self.arena = 0
        self.lower_bound = 0
        self.peak_slot = 0
        self.slot = 0
        self._columns: dict[int, tuple[int, int]] = {}  # column -> (max bytes, slot of max)
        self._columns_scale = 0.0

    def set_curve(self, curve: list[int], arena: int, lower_bound: int) -> None:
        self.curve = curve
        self.num_slots = len(curve)
        self.arena = arena
        self.lower_bound = lower_bound
        peak = max(curve, default=0)
        self.peak_slot = curve.index(peak) if curve else 0
        self.slot = self.peak_slot
        self._columns.clear()
        self.update_virtual_size()
        self.scroll_to(x=0, animate=False, immediate=True)

    @property
    def y_max(self) -> int:
        return max(self.arena, self.lower_bound, max(self.curve, default=0), 1)

    def content_rows(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def column_value(self, column: int) -> tuple[int, int]:
        """(highest live bytes among the column's slots, the first slot reaching it)."""
        if self._columns_scale != self.scale:
            self._columns.clear()
            self._columns_scale = self.scale
        cached = self._columns.get(column)
        if cached is None:
            lo, hi = self.slots_of(column)
            window = self.curve[lo : hi + 1]
            best = max(window, default=0)
            cached = (best, lo + window.index(best) if window else lo)
            self._columns[column] = cached
        return cached

    # ----------------------------------------------------------------------------- actions

    def anchor_slot(self) -> int | None:
        return self.slot if self.curve else None

    def choose(self, slot: int) -> None:
        if not self.curve:
            return
        self.slot = max(0, min(self.num_slots - 1, slot))
        self.refresh()
        column = self.columns_of(self.slot, self.slot)[0]
        if not self.scroll_x <= column < self.scroll_x + self.timeline_width:
            self.scroll_to(
                x=max(0, column - self.timeline_width // 2), animate=False, immediate=True
            )
        self.post_message(self.SlotChosen(self, self.slot))

    def action_step(self, direction: int) -> None:
        lo, hi = self.slots_of(self.columns_of(self.slot, self.slot)[0])
        self.choose(hi + 1 if direction > 0 else lo - 1)

    def action_peak(self) -> None:
        self.choose(self.peak_slot)

    def on_click(self, event: events.Click) -> None:
        x = event.x - self.label_width
        if x >= 0 and self.curve:
            self.choose(self.column_value(int(self.scroll_x) + x)[1])

    # ---------------------------------------------------------------------------- drawing

    def _level_row(self, value: int, rows: int) -> int:
        """The line (0 = top) on which a horizontal line at ``value`` bytes is drawn."""
        level = value / self.y_max * rows
        return max(0, min(rows - 1, rows - math.ceil(level - 1e-9)))

    def render_label(self, row: int, width: int) -> Strip:
        rows = self.content_rows()
        style = self.get_component_rich_style("timechart--label")
        text = ""
        if row == 0:
            text = human(self.y_max, 1)
        elif row == rows // 2:
            text = human(self.y_max / 2, 1)
        elif row == rows - 1:
            text = "0 B"
        return Strip([Segment(f"{text:>{width - 1}} ", style)])

    def render_row(self, row: int, c0: int, c1: int) -> Strip:
        rows = self.content_rows()
        arena_row = self._level_row(self.arena, rows)
        bound_row = self._level_row(self.lower_bound, rows)
        slot_column = self.columns_of(self.slot, self.slot)[0]
        peak_column = self.columns_of(self.peak_slot, self.peak_slot)[0]
        # Only the background: the bar keeps its own colour in the inspected column.
        cursor = Style(bgcolor=self.get_component_rich_style("timechart--cursor").bgcolor)
        limit = self.total_cells
        cells: list[tuple[str, Style]] = []
        for column in range(c0, c1):
            if column >= limit:
                cells.append((" ", _NONE))
                continue
            value, _ = self.column_value(column)
            level = value / self.y_max * rows
            fill = min(1.0, max(0.0, level - (rows - row - 1)))
            char = _BLOCKS[round(fill * 8)]
            style = _PEAK if column == peak_column else _FILL
            if char == " ":
                if row == arena_row:
                    char, style = "─", _ARENA
                elif row == bound_row:
                    char, style = "╌", _BOUND
            if column == slot_column:
                style = style + cursor
            cells.append((char, style))
        return cells_to_strip(cells, self.rich_style)
