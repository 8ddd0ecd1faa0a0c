"""Diff (two plans): envelope deltas by component, bounds and fingerprint changes, Table-1 deltas,
the change in predicted decode tok/s and TTFT, and intermediate bytes by module."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from dctms.figures.comparison import Change, Delta, plan_diff
from dctms.figures.module_diff import ModuleDelta, module_deltas
from dctms.figures.roofline import prediction_profile
from dctms.figures.units import human
from dctms.tui.screens.base import InspectorScreen
from dctms.tui.widgets.scroll import PageScroll

CHANGED = "bold #e5c07b"


def _value(value: int | float | None, digits: int) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _signed(value: int | float | None, digits: int, up_is_good: bool = False) -> Text:
    if value is None:
        return Text("—", justify="right")
    worse = value < 0 if up_is_good else value > 0
    style = "" if value == 0 else ("#e06c75" if worse else "#98c379")
    text = f"{value:+,.{digits}f}" if isinstance(value, float) else f"{value:+,}"
    return Text(text, style=style, justify="right")


def delta_table(title: str, rows: list[Delta], *, mib: bool, digits: int = 0) -> Table:
    """Old, new, change (and MiB, %) per figure; growth is red, shrinkage green (for a speed,
    ``tok/s``, the other way round)."""
    table = Table(title=title, title_justify="left", box=None, padding=(0, 1))
    table.add_column("")
    table.add_column("old", justify="right")
    table.add_column("new", justify="right")
    table.add_column("Δ", justify="right")
    if mib:
        table.add_column("Δ MiB", justify="right")
    table.add_column("Δ %", justify="right")
    for row in rows:
        d = row.delta
        precise = digits if isinstance(d, float) or isinstance(row.old, float) else 0
        up_is_good = "tok/s" in row.name
        cells = [
            Text(row.name, style=CHANGED if row.changed else ""),
            _value(row.old, precise),
            _value(row.new, precise),
            _signed(d, precise, up_is_good),
        ]
        if mib:
            cells.append(_signed(row.delta_mib, 2))
        cells.append(
            _signed(row.percent, 2, up_is_good)
            if row.percent is not None
            else Text("—", justify="right")
        )
        table.add_row(*cells)
    return table


def change_table(title: str, rows: list[Change]) -> Table:
    table = Table(title=title, title_justify="left", box=None, padding=(0, 1))
    table.add_column("")
    table.add_column("old")
    table.add_column("new")
    table.add_column("")
    for row in rows:
        mark = Text("changed", style=CHANGED) if row.changed else Text("same", style="dim")
        name = Text(row.name, style=CHANGED if row.changed else "")
        table.add_row(name, row.old_text, row.new_text, mark)
    return table


MODULE_ROWS = 12


def module_table(rows: list[ModuleDelta]) -> Table:
    """Intermediate bytes by module (layers as *): at each phase's peak and over all tenants."""
    more = f", largest {MODULE_ROWS} of {len(rows)}" if len(rows) > MODULE_ROWS else ""
    table = Table(
        title=f"Intermediate bytes by module (layers as *{more})",
        title_justify="left",
        box=None,
        padding=(0, 1),
    )
    for name, justify in (("phase", "left"), ("module", "left"), ("peak old", "right")):
        table.add_column(name, justify=justify)
    for name in ("peak new", "Δ peak", "Δ tenants"):
        table.add_column(name, justify="right")
    for r in rows[:MODULE_ROWS]:
        table.add_row(
            r.phase,
            r.module,
            human(r.old_peak),
            human(r.new_peak),
            _signed(r.peak_delta, 0),
            _signed(r.bytes_delta, 0),
        )
    return table


class DiffScreen(InspectorScreen):
    MODE = "diff"
    TITLE = "Diff"

    def compose_body(self) -> ComposeResult:
        inspection = self.inspection
        assert inspection.old is not None and inspection.old_path is not None
        diff = plan_diff(inspection.old, inspection.plan)
        with PageScroll(id="diff"):
            yield Static(
                f"[b]{inspection.old_path}[/b] → [b]{inspection.path}[/b]: {diff.changed} figure(s) differ"
                "   [dim](other screens show the new plan)[/dim]",
                id="diff-header",
            )
            yield Static(
                delta_table("Memory envelope", diff.envelope, mib=True), id="diff-envelope"
            )
            yield Static(
                delta_table("Table 1 and arena", diff.table1, mib=False, digits=4), id="diff-table1"
            )
            yield Static(change_table("Bounds", diff.bounds), id="diff-bounds")
            yield Static(change_table("Model fingerprint", diff.fingerprint), id="diff-fingerprint")
            yield Static(delta_table("Phases", diff.phases, mib=False), id="diff-phases")
            profiles = {prediction_profile(p).name for p in (inspection.old, inspection.plan)}
            yield Static(
                delta_table(
                    f"Predicted at the roofline ({' -> '.join(sorted(profiles))})",
                    diff.roofline,
                    mib=False,
                    digits=3,
                ),
                id="diff-roofline",
            )
            rows = module_deltas(inspection.old, inspection.plan)
            if rows:
                yield Static(module_table(rows), id="diff-modules")
