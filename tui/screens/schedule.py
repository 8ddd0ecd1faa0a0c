"""Schedule: the slots with their ops, and the sync points with the tensors each one evaluates."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import Static

from dctms.figures.units import exact_bytes
from dctms.tui.data import PhaseLookup, Query, op_matches, slot_rows
from dctms.tui.screens.base import SearchScreen
from dctms.tui.widgets.table import Column, VirtualTable

SLOT_COLUMNS = [
    Column("slot", "slot", numeric=True),
    Column("ops", "ops"),
    Column("#", "n", numeric=True),
    Column("mem-bound", "mb", numeric=True),
    Column("live bytes", "live", numeric=True),
    Column("sync after", "sync"),
]
SYNC_COLUMNS = [
    Column("slot", "slot", numeric=True),
    Column("reason", "reason"),
    Column("#eval", "n", numeric=True),
    Column("tensors", "tensors", max_width=32),
]
MAX_OPS_TEXT = 48  # characters of a slot's op list in the table; the details show every op


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ScheduleScreen(SearchScreen):
    MODE = "schedule"
    TITLE = "Schedule"
    SEARCH_PLACEHOLDER = "/ filter slots by their ops: prim:NAME, layer:N, tensor id"

    BINDINGS = [
        Binding("e", "other_table", "slots ⇄ syncs"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.query_filter = Query()

    def compose_body(self) -> ComposeResult:
        yield self.search_box()
        with Horizontal(id="schedule-tables"):
            yield VirtualTable(SLOT_COLUMNS, id="slots")
            yield VirtualTable(SYNC_COLUMNS, id="syncs")
        yield Static(id="schedule-details")

    def on_mount(self) -> None:
        super().on_mount()
        self.main_widget().focus()

    def main_widget(self) -> Widget:
        return self.query_one("#slots", VirtualTable)

    def load_phase(self, index: PhaseLookup) -> None:
        self.rows = slot_rows(index)
        points = index.phase.sync_points
        self.query_one("#syncs", VirtualTable).set_rows(
            [
                (str(sp.slot), sp.reason, str(len(sp.evaluate)), clip(" ".join(sp.evaluate), 40))
                for sp in points
            ],
            [str(n) for n in range(len(points))],
        )
        self.refill()

    def refill(self) -> None:
        query = self.query_filter
        index = self.index
        assert index is not None
        shown = [
            r
            for r in self.rows
            if query.empty or any(op_matches(op, query, index.op_module(op.index)) for op in r.ops)
        ]
        self.query_one("#slots", VirtualTable).set_rows(
            [
                (
                    str(r.slot),
                    clip(" · ".join(f"{op.index} {op.primitive}" for op in r.ops), MAX_OPS_TEXT),
                    str(len(r.ops)),
                    str(r.memory_bound),
                    f"{r.live_bytes:,}",
                    r.sync,
                )
                for r in shown
            ],
            [str(r.slot) for r in shown],
        )

    def apply_search(self, query: Query) -> None:
        self.query_filter = query
        self.refill()

    def action_other_table(self) -> None:
        slots, syncs = self.query_one("#slots"), self.query_one("#syncs")
        (syncs if slots.has_focus else slots).focus()

    def on_virtual_table_highlighted(self, event: VirtualTable.Highlighted) -> None:
        # Only the focused table drives the details (both post when they are filled).
        if self.index is None or event.key is None or not event.table.has_focus:
            return
        details = self.query_one("#schedule-details", Static)
        if event.table.id == "slots":
            details.update(self.slot_text(int(event.key)))
        else:
            details.update(self.sync_text(int(event.key)))

    def on_descendant_focus(self) -> None:
        focused = self.focused
        if isinstance(focused, VirtualTable) and focused.selected_key is not None:
            focused.select(focused.cursor, force=True)

    def slot_text(self, slot: int) -> str:
        row = self.rows[slot]
        index = self.index
        assert index is not None
        ops = "\n".join(
            f"  op {op.index} {op.primitive}"
            + ("" if index.op_module(op.index) is None else f" ({index.op_module(op.index)})")
            + (" memory-bound" if op.memory_bound else "")
            + f": {', '.join(op.inputs)} -> {', '.join(op.outputs)}"
            for op in row.ops
        )
        sync = f"; sync point after it: {row.sync}" if row.sync else ""
        return (
            f"[b]slot {row.slot}[/b]: {len(row.ops)} op(s), live {exact_bytes(row.live_bytes)}"
            f"{escape(sync)}\n{escape(ops)}"
        )

    def sync_text(self, number: int) -> str:
        assert self.index is not None
        sp = self.index.phase.sync_points[number]
        return (
            f"[b]sync point after slot {sp.slot}[/b]: {escape(sp.reason)}; evaluates "
            f"{len(sp.evaluate)} tensor(s):\n{escape(' '.join(sp.evaluate)) or 'none'}"
        )
