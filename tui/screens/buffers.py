"""Buffers: each physical buffer's tenants over time (the reuse view) and the arena's offset x time map."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Static

from dctms.figures.units import exact_bytes
from dctms.tui.data import (
    PhaseLookup,
    Query,
    arena_placements,
    buffer_rows,
    buffer_summaries,
    short_module,
)
from dctms.tui.screens.base import SearchScreen
from dctms.tui.widgets.arena_map import ArenaMap
from dctms.tui.widgets.gantt import Gantt
from dctms.tui.widgets.timechart import TimeChart

MAX_TENANTS_SHOWN = 12


class BuffersScreen(SearchScreen):
    MODE = "buffers"
    TITLE = "Buffers"
    SEARCH_PLACEHOLDER = "/ filter tenants: name, module, mod:mlp, layer:N, prim:NAME, buf:N"

    def __init__(self) -> None:
        super().__init__()
        self.query_filter = Query()

    def compose_body(self) -> ComposeResult:
        yield Static(id="buffers-summary")
        yield self.search_box()
        yield Gantt(id="reuse")
        yield Static(id="buffer-details")
        yield Static(id="arena-title", classes="section")
        yield ArenaMap(id="arena-map")

    def on_mount(self) -> None:
        super().on_mount()
        self.main_widget().focus()

    def main_widget(self) -> Widget:
        return self.query_one("#reuse", Gantt)

    def load_phase(self, index: PhaseLookup) -> None:
        phase = index.phase
        summaries = buffer_summaries(index)
        colouring = sum(b.bytes for b in phase.buffers)
        self.summaries = {s.id: s for s in summaries}
        self.query_one("#buffers-summary", Static).update(
            f"[b]{len(phase.buffers)} physical buffers[/b] for "
            f"{sum(s.tenants for s in summaries):,} tenants; sum of buffer sizes {exact_bytes(colouring)}   "
            f"arena {exact_bytes(phase.arena_bytes)}   lower bound {exact_bytes(phase.lower_bound_bytes)}"
        )
        self.query_one("#arena-title", Static).update(
            f"[b]Arena: offset × slot[/b] (0 .. {phase.arena_bytes:,} bytes; colour = buffer; "
            "· = free bytes)"
        )
        self.refill()
        self.query_one(ArenaMap).set_arena(
            arena_placements(index), phase.arena_bytes, index.num_slots
        )

    def refill(self, keep: str | None = None) -> None:
        if self.index is not None:
            rows = buffer_rows(self.index, self.query_filter)
            self.query_one("#reuse", Gantt).set_rows(rows, self.index.num_slots, keep)

    def apply_search(self, query: Query) -> None:
        self.query_filter = query
        selected = self.query_one("#reuse", Gantt).selected
        self.refill(selected.key if selected else None)

    def on_gantt_selected(self, event: Gantt.Selected) -> None:
        details = self.query_one("#buffer-details", Static)
        row, index = event.row, self.index
        if row is None or index is None or row.buffer is None:
            details.update("[dim]no buffer matches the filter[/dim]")
            return
        s = self.summaries[row.buffer]
        span = "never used" if s.first_slot is None else f"slots {s.first_slot}..{s.last_slot}"
        tenants = "  ".join(
            f"{escape(index.tensor[bar.tensor].id)} "
            f"({escape(short_module(index.module_of(bar.tensor)) or '?')}) [{bar.start},{bar.end}] "
            f"{index.tensor[bar.tensor].bytes:,} B @{index.tensor[bar.tensor].offset:,}"
            for bar in row.bars[:MAX_TENANTS_SHOWN]
        )
        more = len(row.bars) - MAX_TENANTS_SHOWN
        details.update(
            f"[b]buffer {s.id}[/b]  {exact_bytes(s.bytes)}  {s.tenants} tenant(s), {span}, "
            f"busy {s.busy_slots} of {index.num_slots} slots, largest tenant {s.largest_tenant:,} B\n"
            f"{tenants}" + (f"  +{more} more" if more > 0 else "")
        )

    def on_time_chart_viewport(self, event: TimeChart.Viewport) -> None:
        # Zoom and pan the two charts together: they share the slot axis.
        for chart in self.query(TimeChart):
            if chart is not event.chart:
                chart.set_viewport(event.scale, event.scroll_x, fitted=event.chart.fitted)
