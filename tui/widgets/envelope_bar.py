"""The memory envelope as one stacked horizontal bar, with M_max, the device budget and what is
free of it, labelled as ``dctms show`` labels them (the vocabulary of docs/explanation/envelope.md)."""

from __future__ import annotations

from rich.console import Group
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from dctms.figures.overview import COMPONENTS
from dctms.figures.units import exact_bytes
from dctms.schema.types import Envelope

COLOURS = {
    "weights": "#61afef",
    "kv": "#c678dd",
    "persistent": "#e5c07b",
    "intermediate": "#98c379",
    "runtime": "#d19a66",
}


def split_cells(values: list[int], scale_max: int, width: int) -> list[int]:
    """Cells per value, proportional to ``scale_max`` over ``width`` cells, rounded so that the
    cumulative edges land where exact proportions put them (no drift from rounding each part)."""
    cells, done, running = [], 0, 0
    for value in values:
        running += value
        edge = round(running / scale_max * width) if scale_max else 0
        cells.append(max(0, edge - done))
        done += cells[-1]
    return cells


class EnvelopeBar(Widget):
    DEFAULT_CSS = "EnvelopeBar { height: auto; }"

    def __init__(self, envelope: Envelope, *, id: str | None = None):
        super().__init__(id=id)
        self.envelope = envelope

    def render(self) -> Group:
        e = self.envelope
        width = max(10, self.size.width - 2)
        scale_max = max(e.total, e.device or 0)
        parts = [getattr(e, name) for name in COMPONENTS]
        bar = Text()
        for name, cells in zip(COMPONENTS, split_cells(parts, scale_max, width), strict=True):
            bar.append("█" * cells, Style(color=COLOURS[name]))
        used = bar.cell_len
        if e.device is not None and e.device > e.total:
            bar.append("░" * (width - used), Style(color="grey50"))
        markers = [" "] * (width + 1)
        total_at = min(width, round(e.total / scale_max * width)) if scale_max else 0
        notes = [(total_at, "▲ M_max")]
        if e.device is not None:
            notes.append((min(width, round(e.device / scale_max * width)), "▲ device"))
        for at, label in sorted(notes):
            start = max(0, min(at - 1, width + 1 - len(label)))
            while start < len(markers) and markers[start] != " ":
                start += 1
            for i, char in enumerate(label):
                if start + i < len(markers):
                    markers[start + i] = char
        marker_line = Text("".join(markers).rstrip(), Style(color="grey70"))

        legend = Table.grid(padding=(0, 2))
        legend.add_column()
        legend.add_column(justify="right")
        legend.add_column(justify="right")
        for name in COMPONENTS:
            value = getattr(e, name)
            share = f"{100 * value / e.total:.2f} %" if e.total else ""
            legend.add_row(
                Text("■ ", Style(color=COLOURS[name])) + Text(name), exact_bytes(value), share
            )
        legend.add_row(Text("total = M_max", Style(bold=True)), exact_bytes(e.total), "100 %")
        if e.device is not None:
            legend.add_row("device", exact_bytes(e.device), "")
        if e.free is not None:
            fits = e.free >= 0
            legend.add_row(
                Text("free", Style(color="green" if fits else "red")),
                exact_bytes(e.free),
                Text("fits" if fits else "does not fit", Style(color="green" if fits else "red")),
            )
        parts_out: list = [bar, marker_line, legend]
        if e.runtime_source:
            parts_out.append(Text(f"runtime: {e.runtime_source}", Style(dim=True)))
        return Group(*parts_out)
