"""Offset x time map of a phase's arena: each line is a band of bytes, each cell a slot range.

A cell is drawn in the colour of the buffer whose tenant occupies the most bytes of that band during
the cell's slots; empty bytes stay blank, so the gaps the packer left are visible.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip

from dctms.figures.units import human
from dctms.tui.data import Placement, arena_bands
from dctms.tui.widgets.timechart import TimeChart, buffer_style, cells_to_strip

_NONE = Style()


class ArenaMap(TimeChart):
    LABEL_WIDTH = 12

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(0, id=id, classes=classes)
        self.placements: list[Placement] = []
        self.arena_bytes = 0
        self._bands: list[list[Placement]] = []
        self._owners: dict[
            int, list[tuple[int, int | None]]
        ] = {}  # band -> per slot (bytes, buffer)

    def set_arena(self, placements: list[Placement], arena_bytes: int, num_slots: int) -> None:
        self.placements = placements
        self.arena_bytes = arena_bytes
        self.num_slots = num_slots
        self._bands = []
        self._owners.clear()
        self.update_virtual_size()
        self.scroll_to(x=0, animate=False, immediate=True)

    def content_rows(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def band_bytes(self) -> float:
        return self.arena_bytes / self.content_rows() if self.arena_bytes else 0.0

    def update_virtual_size(self) -> None:
        bands = self.content_rows()
        if len(self._bands) != bands:
            self._bands = arena_bands(self.placements, self.arena_bytes, bands)
            self._owners.clear()
        super().update_virtual_size()

    def owners(self, band: int) -> list[tuple[int, int | None]]:
        """Per slot of the phase: (bytes of the band's largest occupant, its buffer); built lazily."""
        cached = self._owners.get(band)
        if cached is None:
            lo = band * self.arena_bytes // max(1, len(self._bands))
            hi = (band + 1) * self.arena_bytes // max(1, len(self._bands))
            cached = [(0, None)] * self.num_slots
            for p in self._bands[band] if band < len(self._bands) else ():
                overlap = min(hi, p.end) - max(lo, p.offset)
                for slot in range(p.start, min(p.end_slot, self.num_slots - 1) + 1):
                    if overlap > cached[slot][0]:
                        cached[slot] = (overlap, p.buffer)
            self._owners[band] = cached
        return cached

    def render_label(self, row: int, width: int) -> Strip:
        style = self.get_component_rich_style("timechart--label")
        rows = self.content_rows()
        text = ""
        if row in (0, rows // 2, rows - 1) or (rows > 12 and row in (rows // 4, 3 * rows // 4)):
            text = human(row * self.band_bytes(), 1)
        return Strip([Segment(f"{text:>{width - 1}} ", style)])

    def render_row(self, row: int, c0: int, c1: int) -> Strip:
        owners = self.owners(row) if self.num_slots else []
        limit = self.total_cells
        cells: list[tuple[str, Style]] = []
        for column in range(c0, c1):
            if column >= limit or not owners:
                cells.append((" ", _NONE))
                continue
            lo, hi = self.slots_of(column)
            best = max(owners[lo : hi + 1], key=lambda o: o[0])
            if best[0] == 0:
                cells.append(("·", Style(color="grey30")))
            else:
                cells.append(("█", buffer_style(best[1])))
        return cells_to_strip(cells, self.rich_style)
