"""Overview: bounds, the envelope bar (M_max, device, M_free), Table 1, arena vs lower bound."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from dctms.figures.overview import arena_rows, bounds_rows, header, table1
from dctms.tui.screens.base import InspectorScreen
from dctms.tui.widgets.envelope_bar import EnvelopeBar
from dctms.tui.widgets.scroll import PageScroll


class OverviewScreen(InspectorScreen):
    MODE = "overview"
    TITLE = "Overview"

    def compose_body(self) -> ComposeResult:
        plan = self.inspection.plan
        h = header(plan)
        with PageScroll(id="overview"):
            yield Static(
                f"[b]{h.architecture}[/b], {h.num_layers} layers, {h.weight_tensors:,} weight "
                f"tensors, target {h.backend} (alignment {h.alignment})  [dim]schema "
                f"v{h.schema_version}; {h.generator}[/dim]",
                id="header",
            )
            yield Static("[b]Memory envelope[/b]", classes="section")
            yield EnvelopeBar(plan.envelope, id="envelope")
            with Horizontal(id="figures"):
                yield Static(self._bounds(), id="bounds", classes="figure")
                yield Static(self._table1(), id="table1", classes="figure")
            yield Static(self._arena(), id="arena", classes="figure")

    def _bounds(self) -> Table:
        table = Table(title="Bounds", title_justify="left", show_header=False, box=None)
        table.add_column(style="dim")
        table.add_column()
        for name, value in bounds_rows(self.inspection.plan):
            table.add_row(name, value)
        return table

    def _table1(self) -> Table:
        t1 = table1(self.inspection.plan)
        table = Table(title="Table 1: interval colouring", title_justify="left", box=None)
        table.add_column("")
        table.add_column("this plan", justify="right")
        table.add_column("paper", justify="right")
        table.add_row("logical tensors", f"{t1.logical_tensors:,}", f"{t1.paper_logical:,}")
        table.add_row("physical buffers", f"{t1.physical_buffers:,}", f"{t1.paper_physical:,}")
        table.add_row("reduction", f"{t1.reduction:.2%}", f"{t1.paper_reduction:.2%}")
        return table

    def _arena(self) -> Table:
        table = Table(title="Arena vs lower bound", title_justify="left", box=None)
        table.add_column("phase")
        table.add_column("arena bytes", justify="right")
        table.add_column("lower bound bytes", justify="right")
        table.add_column("arena / bound", justify="right")
        for row in arena_rows(self.inspection.plan):
            ratio = "n/a" if row.ratio is None else f"{row.ratio:.3f}"
            table.add_row(row.name, f"{row.arena:,}", f"{row.lower_bound:,}", ratio)
        return table
