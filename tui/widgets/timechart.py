"""Base of the slot-time charts (Gantt, memory curve, arena map): Line API, only visible cells drawn.

Layout of every line: a fixed label column (not scrolled horizontally), then the visible part of the
timeline. The first line is a sticky slot axis. ``scale`` is cells per slot (< 1 when zoomed out, in
which case one cell summarises several slots); "fit" picks the scale that shows every slot.
"""

from __future__ import annotations

import math
from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

MAX_SCALE = 16.0  # cells per slot when fully zoomed in
_EPS = 1e-9

# Buffer ids cycle through these (readable on dark and light themes).
PALETTE = [
    "#e06c75",
    "#98c379",
    "#e5c07b",
    "#61afef",
    "#c678dd",
    "#56b6c2",
    "#d19a66",
    "#7ec699",
    "#f0a6ca",
    "#9da5f5",
    "#c8c85a",
    "#be5046",
]


@lru_cache(maxsize=1024)  # Style objects are immutable; one per buffer id
def buffer_style(buffer: int | None) -> Style:
    """Colour of a buffer; views and state (no bytes of their own) are grey."""
    if buffer is None:
        return Style(color="grey50")
    return Style(color=PALETTE[buffer % len(PALETTE)])


def nice_step(minimum: float) -> int:
    """The smallest 1, 2 or 5 times a power of ten that is >= ``minimum`` (tick spacing in slots)."""
    if minimum <= 1:
        return 1
    power = 10 ** math.floor(math.log10(minimum))
    for factor in (1, 2, 5, 10):
        if factor * power >= minimum:
            return int(factor * power)
    return int(10 * power)


class TimeChart(ScrollView, can_focus=True):
    """A horizontally zoomable, scrollable chart over ``num_slots`` slots."""

    BINDINGS = [
        Binding("plus,equals_sign", "zoom(2)", "zoom", key_display="+/-"),
        Binding("minus", "zoom(0.5)", "zoom out", show=False),
        Binding("left,h", "pan(-1)", "pan", key_display="←→/hl"),
        Binding("right,l", "pan(1)", "pan right", show=False),
        Binding("f", "fit", "fit", show=False),
    ]

    COMPONENT_CLASSES = {"timechart--label", "timechart--axis", "timechart--cursor"}

    LABEL_WIDTH = 30

    class Viewport(Message):
        """Posted when the scale or horizontal position changes (to keep charts in step)."""

        def __init__(self, chart: TimeChart, scale: float, scroll_x: float) -> None:
            super().__init__()
            self.chart = chart
            self.scale = scale
            self.scroll_x = scroll_x

    def __init__(self, num_slots: int = 0, *, id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes)
        self.num_slots = num_slots
        self.scale = 1.0
        self.fitted = True  # follow the widget's width until the user zooms

    # ------------------------------------------------------------------------------ geometry

    @property
    def label_width(self) -> int:
        return min(self.LABEL_WIDTH, max(0, self.size.width - 10))

    @property
    def timeline_width(self) -> int:
        """Visible timeline cells."""
        return max(1, self.scrollable_content_region.width - self.label_width)

    @property
    def total_cells(self) -> int:
        return max(1, math.ceil(self.num_slots * self.scale - _EPS))

    def content_rows(self) -> int:
        """Lines below the axis; subclasses say how many."""
        return 0

    def fit_scale(self) -> float:
        return min(MAX_SCALE, self.timeline_width / max(1, self.num_slots))

    def columns_of(self, start: int, end: int) -> tuple[int, int]:
        """Cells ``c0..c1`` (inclusive) covered by slots ``start..end``."""
        c0 = int(start * self.scale + _EPS)
        c1 = math.ceil((end + 1) * self.scale - _EPS) - 1
        return c0, max(c0, c1)

    def slots_of(self, column: int) -> tuple[int, int]:
        """Slots ``lo..hi`` (inclusive) shown in cell ``column``, clipped to the phase."""
        lo = int(column / self.scale + _EPS)
        hi = max(lo, math.ceil((column + 1) / self.scale - _EPS) - 1)
        last = max(0, self.num_slots - 1)
        return min(lo, last), min(hi, last)

    def update_virtual_size(self) -> None:
        if self.fitted:
            self.scale = self.fit_scale()
        self.virtual_size = Size(self.label_width + self.total_cells, 1 + self.content_rows())
        self.refresh()

    def on_resize(self) -> None:
        self.update_virtual_size()

    # ------------------------------------------------------------------------------- actions

    def set_viewport(self, scale: float, scroll_x: float, *, fitted: bool = False) -> None:
        """Show ``scale`` cells per slot from cell ``scroll_x`` (used to keep charts in step)."""
        self.fitted = fitted
        self.scale = scale
        self.update_virtual_size()
        self.scroll_to(x=scroll_x, animate=False, immediate=True)

    def anchor_slot(self) -> int | None:
        """The slot zooming keeps in place (the selection); ``None``: the middle of the view."""
        return None

    def action_zoom(self, factor: float) -> None:
        width = self.timeline_width
        anchor = self.anchor_slot()
        at = width / 2  # where on screen the anchor stays
        if anchor is None:
            slot = (self.scroll_x + at) / self.scale
        else:
            slot = float(anchor)
            column = self.columns_of(anchor, anchor)[0] - self.scroll_x
            at = column if 0 <= column < width else at
        scale = min(MAX_SCALE, max(self.fit_scale(), self.scale * float(factor)))
        self.fitted = scale <= self.fit_scale()
        self.scale = scale
        self.update_virtual_size()
        self.scroll_to(x=max(0.0, slot * scale - at), animate=False, immediate=True)
        self.post_message(self.Viewport(self, self.scale, self.scroll_x))

    def show_slots(self, start: int, end: int) -> None:
        """Scroll horizontally so that slots ``start..end`` are (at least partly) in view."""
        c0, c1 = self.columns_of(start, end)
        width = self.timeline_width
        if c1 < self.scroll_x or c0 >= self.scroll_x + width:
            self.scroll_to(x=max(0, c0 - width // 4), animate=False, immediate=True)
            self.post_message(self.Viewport(self, self.scale, self.scroll_x))

    def action_fit(self) -> None:
        self.fitted = True
        self.update_virtual_size()
        self.scroll_to(x=0, animate=False, immediate=True)
        self.post_message(self.Viewport(self, self.scale, self.scroll_x))

    def action_pan(self, direction: int) -> None:
        step = max(1, self.timeline_width // 8)
        self.scroll_to(x=self.scroll_x + direction * step, animate=False, immediate=True)
        self.post_message(self.Viewport(self, self.scale, self.scroll_x))

    # ----------------------------------------------------------------------------- rendering

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        label_w = self.label_width
        c0 = int(self.scroll_x)
        c1 = c0 + width - label_w  # exclusive
        if y == 0:
            label, body = self.render_axis_label(label_w), self.render_axis(c0, c1)
        else:
            row = int(self.scroll_y) + y - 1
            if row >= self.content_rows():
                return Strip.blank(width, self.rich_style)
            label, body = self.render_label(row, label_w), self.render_row(row, c0, c1)
        label = label.adjust_cell_length(label_w, self.rich_style)
        body = body.adjust_cell_length(width - label_w, self.rich_style)
        return Strip.join([label, body]).simplify()

    def render_axis_label(self, width: int) -> Strip:
        style = self.get_component_rich_style("timechart--axis")
        return Strip([Segment(f"{'slot':>{width - 1}} ", style)])

    def render_axis(self, c0: int, c1: int) -> Strip:
        """Slot numbers at ticks at least 10 cells apart."""
        style = self.get_component_rich_style("timechart--axis")
        cells = [" "] * max(0, c1 - c0)
        step = nice_step(10 / self.scale)
        first_slot = self.slots_of(c0)[0]
        tick = (first_slot // step) * step
        last_written = -1
        while tick < self.num_slots:
            column = self.columns_of(tick, tick)[0]
            if column >= c1:
                break
            text = f"╵{tick}"
            at = column - c0
            if at >= 0 and at > last_written:
                for i, char in enumerate(text):
                    if at + i < len(cells):
                        cells[at + i] = char
                last_written = at + len(text)
            tick += step
        return Strip([Segment("".join(cells), style)])

    def render_label(self, row: int, width: int) -> Strip:
        return Strip.blank(width, self.rich_style)

    def render_row(self, row: int, c0: int, c1: int) -> Strip:
        return Strip.blank(max(0, c1 - c0), self.rich_style)


def cells_to_strip(cells: list[tuple[str, Style]], base: Style) -> Strip:
    """Merge runs of equally styled characters into segments (fewer segments, faster to draw)."""
    segments: list[Segment] = []
    run: list[str] = []
    current: Style | None = None
    for char, style in cells:
        if style is not current and style != current:
            if run:
                segments.append(Segment("".join(run), base + current if current else base))
            run, current = [], style
        run.append(char)
    if run:
        segments.append(Segment("".join(run), base + current if current else base))
    return Strip(segments)
