"""Lifetimes: a Gantt chart of tensor (or buffer) intervals, filterable, with the selection's details."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widget import Widget
from textual.widgets import Static

from dctms.figures.units import exact_bytes
from dctms.schema.numbered import NumberedOp
from dctms.tui.data import (
    MODULE_ROW,
    PhaseLookup,
    Query,
    Row,
    buffer_rows,
    fmt_shape,
    tensor_details,
    tensor_rows,
)
from dctms.tui.screens.base import SearchScreen
from dctms.tui.widgets.gantt import Gantt

MAX_CONSUMERS_SHOWN = 8


def op_text(index: PhaseLookup, op: NumberedOp) -> str:
    slot = index.slot_of_op.get(op.index)
    module = index.op_module(op.index)
    return f"op {op.index} {op.primitive} (slot {slot}" + (f", {module})" if module else ")")


def tensor_text(index: PhaseLookup, tensor_id: str) -> str:
    """The details panel for one tensor: every figure the plan holds about it."""
    d = tensor_details(index, tensor_id)
    if d is None:
        return ""
    t = d.tensor
    a, b = t.interval
    lines = [
        f"[b]{escape(t.id)}[/b]  {fmt_shape(t.shape)} {t.dtype}  {exact_bytes(t.bytes)}  kind {t.kind}",
        f"interval [{a}, {b}] ({b - a + 1} slots)",
    ]
    module = index.module_of(t.id)
    if module is not None:
        lines.insert(1, f"module {escape(module)}")
    if t.view_of is not None:
        lines[-1] += f"   view of {escape(t.view_of)} (no bytes of its own)"
    elif t.buffer is not None:
        where = f"   buffer {t.buffer}"
        if t.offset is not None:
            where += f"   offset {t.offset:,} (arena bytes [{t.offset:,}, {t.offset + t.bytes:,}))"
        lines[-1] += where
    producer = "none (graph input)" if d.producer is None else op_text(index, d.producer)
    lines.append(f"producer: {producer}")
    shown = ", ".join(op_text(index, op) for op in d.consumers[:MAX_CONSUMERS_SHOWN])
    more = len(d.consumers) - MAX_CONSUMERS_SHOWN
    lines.append(
        f"consumers ({len(d.consumers)}): {shown or 'none'}"
        + (f", +{more} more" if more > 0 else "")
    )
    return "\n".join(lines)


def buffer_text(index: PhaseLookup, row: Row) -> str:
    buffer = row.buffer
    size = next((b.bytes for b in index.phase.buffers if b.id == buffer), 0)
    tenants = ", ".join(
        f"{escape(bar.tensor)} [{bar.start}, {bar.end}]" for bar in row.bars[:MAX_CONSUMERS_SHOWN]
    )
    more = len(row.bars) - MAX_CONSUMERS_SHOWN
    return (
        f"[b]buffer {buffer}[/b]  {exact_bytes(size)}  {len(row.bars)} tenant(s) shown\n"
        f"tenants: {tenants or 'none'}" + (f", +{more} more" if more > 0 else "")
    )


def module_text(rows: list[Row], heading: Row) -> str:
    """The details panel for a module's heading row: how many tensors its group holds."""
    start = rows.index(heading) + 1
    end = next((i for i in range(start, len(rows)) if not rows[i].bars), len(rows))
    path = heading.key[len(MODULE_ROW) :] or "(no module recorded)"
    return (
        f"[b]module {escape(path)}[/b]: {end - start} tensor(s) below, in slot order  "
        "[dim](g: all tensors in slot order)[/dim]"
    )


class LifetimesScreen(SearchScreen):
    MODE = "lifetimes"
    TITLE = "Lifetimes"
    SEARCH_PLACEHOLDER = (
        "/ filter: name, mod:self_attn, layer:N, prim:NAME, buf:N, kind:scratch (enter applies)"
    )

    BINDINGS = [
        Binding("b", "toggle_buffers", "per buffer"),
        Binding("g", "toggle_grouping", "group by module"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.per_buffer = False
        self.by_module = False
        self.query_filter = Query()

    def compose_body(self) -> ComposeResult:
        yield self.search_box()
        yield Gantt(id="gantt")
        yield Static(id="details")

    def on_mount(self) -> None:
        super().on_mount()
        self.main_widget().focus()

    def main_widget(self) -> Widget:
        return self.query_one(Gantt)

    def load_phase(self, index: PhaseLookup) -> None:
        self.refill()

    def refill(self, keep: str | None = None) -> None:
        if self.index is None:
            return
        if self.per_buffer:
            rows = buffer_rows(self.index, self.query_filter)
        else:
            rows = tensor_rows(self.index, self.query_filter, self.by_module)
        self.query_one(Gantt).set_rows(rows, self.index.num_slots, keep)

    def action_toggle_grouping(self) -> None:
        selected = self.query_one(Gantt).selected
        self.by_module = not self.by_module
        self.refill(selected.key if selected else None)

    def apply_search(self, query: Query) -> None:
        self.query_filter = query
        selected = self.query_one(Gantt).selected
        self.refill(selected.key if selected else None)

    def action_toggle_buffers(self) -> None:
        selected = self.query_one(Gantt).selected
        keep = None
        if (
            selected is not None
        ):  # stay on the same tensor's buffer, or on the buffer's first tenant
            if self.per_buffer:
                keep = selected.bars[0].tensor if selected.bars else None
            elif selected.buffer is not None:
                keep = f"buffer {selected.buffer}"
        self.per_buffer = not self.per_buffer
        self.refill(keep)

    def on_gantt_selected(self, event: Gantt.Selected) -> None:
        details = self.query_one("#details", Static)
        if event.row is None or self.index is None:
            details.update("[dim]no tensor matches the filter[/dim]")
        elif event.row.key.startswith("buffer ") and self.per_buffer:
            details.update(buffer_text(self.index, event.row))
        elif event.row.key.startswith(MODULE_ROW) and not event.row.bars:
            details.update(module_text(event.gantt.rows, event.row))
        else:
            details.update(tensor_text(self.index, event.row.key))
