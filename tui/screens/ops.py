"""Ops: every primitive of the phase with its module, slot, inputs and outputs (shapes), searchable;
sorting by the module column groups the ops by module."""

from __future__ import annotations

import json

from rich.markup import escape
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Static

from dctms.tui.data import PhaseLookup, Query, describe_value, fmt_shape, op_rows
from dctms.tui.screens.base import SearchScreen
from dctms.tui.widgets.table import Column, VirtualTable

COLUMNS = [
    Column("op", "op", numeric=True),
    Column("primitive", "primitive"),
    Column("module", "module", max_width=40),
    Column("slot", "slot", numeric=True),
    Column("inputs", "inputs", max_width=44),
    Column("outputs", "outputs", max_width=28),
    Column("mem-bound", "mb"),
    Column("scratch", "scratch", numeric=True),
]
MAX_ARGS_TEXT = 200


def short_value(index: PhaseLookup, name: str) -> str:
    known = index.shape.get(name)
    return name if known is None else f"{name}{fmt_shape(known[0])}"


def input_text(index: PhaseLookup, name: str) -> str:
    """An op input with its shape, and the parameter or state it is bound to (weights by name)."""
    bound = index.bound_name.get(name)
    return describe_value(index, name) + (f" = {bound}" if bound else "")


class OpsScreen(SearchScreen):
    MODE = "ops"
    TITLE = "Ops"
    SEARCH_PLACEHOLDER = "/ search: primitive, tensor id, module, mod:q_proj, layer:N, prim:NAME"

    def __init__(self) -> None:
        super().__init__()
        self.query_filter = Query()

    def compose_body(self) -> ComposeResult:
        yield self.search_box()
        yield Static(id="ops-count")
        yield VirtualTable(COLUMNS, id="ops")
        yield Static(id="op-details")

    def on_mount(self) -> None:
        super().on_mount()
        self.main_widget().focus()

    def main_widget(self) -> Widget:
        return self.query_one("#ops", VirtualTable)

    def load_phase(self, index: PhaseLookup) -> None:
        self.refill()

    def refill(self) -> None:
        index = self.index
        if index is None:
            return
        ops = op_rows(index, self.query_filter)
        self.query_one("#ops", VirtualTable).set_rows(
            [
                (
                    str(op.index),
                    op.primitive,
                    index.op_module(op.index) or "",
                    str(index.slot_of_op.get(op.index, "")),
                    " ".join(short_value(index, n) for n in op.inputs),
                    " ".join(short_value(index, n) for n in op.outputs),
                    "yes" if op.memory_bound else "",
                    f"{op.scratch:,}" if op.scratch else "",
                )
                for op in ops
            ],
            [str(op.index) for op in ops],
        )
        matched = f" match '{escape(self.query_text)}'" if self.query_text else ""
        self.query_one("#ops-count", Static).update(
            f"{len(ops):,} of {len(index.phase.ops):,} ops{matched}"
        )
        if not ops:
            self.query_one("#op-details", Static).update("[dim]no op matches[/dim]")

    def apply_search(self, query: Query) -> None:
        self.query_filter = query
        self.refill()

    def on_virtual_table_highlighted(self, event: VirtualTable.Highlighted) -> None:
        if event.key is not None:
            self.query_one("#op-details", Static).update(self.op_text(int(event.key)))

    def op_text(self, number: int) -> str:
        index = self.index
        assert index is not None
        op = index.op[number]
        args = json.dumps(op.args)
        if len(args) > MAX_ARGS_TEXT:
            args = args[: MAX_ARGS_TEXT - 1] + "…"
        head = f"[b]op {op.index} {op.primitive}[/b]  slot {index.slot_of_op.get(op.index)}"
        module = index.op_module(op.index)
        if module is not None:
            head += f"  module {escape(module)}"
        if op.memory_bound:
            head += "  memory-bound"
        if op.scratch:
            head += f"  scratch {op.scratch:,} B"
        return "\n".join(
            [
                head,
                "inputs:  " + escape(", ".join(input_text(index, n) for n in op.inputs)),
                "outputs: " + escape(", ".join(describe_value(index, n) for n in op.outputs)),
                "args:    " + escape(args),
            ]
        )
