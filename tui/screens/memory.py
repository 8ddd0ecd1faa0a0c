"""Memory: live bytes over slots (peak, arena and lower-bound lines) and the tensors live at a slot."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from dctms.figures.streams import stream_steps
from dctms.figures.units import exact_bytes, human
from dctms.tui.data import PhaseLookup, fmt_shape
from dctms.tui.screens.base import PhaseScreen
from dctms.tui.widgets.memory_curve import MemoryCurve
from dctms.tui.widgets.stream_bars import StreamBars
from dctms.tui.widgets.table import Column, VirtualTable

COLUMNS = [
    Column("tensor", "tensor"),
    Column("kind", "kind"),
    Column("aligned bytes", "aligned", numeric=True),
    Column("bytes", "bytes", numeric=True),
    Column("interval", "interval"),
    Column("shape", "shape"),
    Column("buffer", "buffer", numeric=True),
    Column("offset", "offset", numeric=True),
    Column("producer", "producer"),
    Column("module", "module", max_width=40),
]


def num(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


class MemoryScreen(PhaseScreen):
    MODE = "memory"
    TITLE = "Memory"

    BINDINGS = [Binding("s", "sort_size", "sort by size")]

    def compose_body(self) -> ComposeResult:
        yield Static(id="memory-summary")
        yield MemoryCurve(id="curve")
        if self.inspection.plan.vision is not None:  # the plan's memory split by stream
            yield StreamBars(id="streams")
        yield Static(id="live-title", classes="section")
        yield VirtualTable(COLUMNS, id="live")

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one(MemoryCurve).focus()
        plan = self.inspection.plan
        if plan.vision is not None:
            self.query_one(StreamBars).show_steps(
                stream_steps(plan), plan.envelope.intermediate, plan.vision.overlap
            )

    def load_phase(self, index: PhaseLookup) -> None:
        phase = index.phase
        slot, peak = index.peak()
        bound = phase.lower_bound_bytes
        ratio = f"{phase.arena_bytes / bound:.3f}" if bound else "n/a"
        self.query_one("#memory-summary", Static).update(
            f"[b]peak {exact_bytes(peak)}[/b] at slot {slot} │ [#e5c07b]── arena[/] "
            f"{phase.arena_bytes:,} B │ [#98c379]╌╌ lower bound[/] {bound:,} B │ "
            f"ratio {ratio}"
        )
        self.query_one(MemoryCurve).set_curve(index.curve, phase.arena_bytes, bound)
        self.show_slot(slot)

    def show_slot(self, slot: int) -> None:
        index = self.index
        if index is None:
            return
        live = index.live_at(slot) if index.num_slots else []
        total = sum(index.aligned(t) for t in live)
        where = "the peak, slot" if slot == index.peak()[0] else "slot"
        by_module: dict[str, int] = {}
        for t in live:
            key = index.module_of(t.id) or "?"
            by_module[key] = by_module.get(key, 0) + index.aligned(t)
        top = sorted(by_module.items(), key=lambda kv: -kv[1])[:3]
        modules = "; ".join(f"{escape(m)} {human(b)}" for m, b in top)
        self.query_one("#live-title", Static).update(
            f"[b]{len(live)} tensors live at {where} {slot}[/b]: {exact_bytes(total)} aligned  "
            "[dim]([ ] other slots, m peak, s sort)[/dim]"
            + (f"\nby module: {modules}" if modules else "")
        )
        rows, keys = [], []
        for t in live:
            op = index.producer_op(t.id)
            rows.append(
                (
                    t.id,
                    t.kind,
                    num(index.aligned(t)),
                    num(t.bytes),
                    f"[{t.interval[0]}, {t.interval[1]}]",
                    f"{fmt_shape(t.shape)} {t.dtype}",
                    num(t.buffer),
                    num(t.offset),
                    "" if op is None else f"{op.index} {op.primitive}",
                    index.module_of(t.id) or "",
                )
            )
            keys.append(t.id)
        table = self.query_one("#live", VirtualTable)
        table.sorted_by = ("aligned", True)  # live_at lists the largest first
        table.set_rows(rows, keys)

    def on_memory_curve_slot_chosen(self, event: MemoryCurve.SlotChosen) -> None:
        self.show_slot(event.slot)

    # Whether ``s`` was pressed: the list opens largest first, and the first ``s`` keeps it so
    # (it says "largest first"); each further ``s`` turns the order round.
    size_sorted = False

    def action_sort_size(self) -> None:
        table = self.query_one("#live", VirtualTable)
        turn = self.size_sorted and table.sorted_by == ("aligned", True)
        table.sort_by("aligned", reverse=not turn)
        self.size_sorted = True
