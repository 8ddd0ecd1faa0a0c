"""Pool: the plan's prompt-prefix pool (``dctms compile --prefix-blocks``) as a block map, and with
``dctms-tui PLAN --run REPORT.json`` the pool over that recorded run: who owns each block at the end
and, per turn, the blocks hit, saved and evicted (``dctms show PLAN --run`` prints the same)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from dctms.figures.overview import pool_label
from dctms.figures.prefix_run import (
    FREE,
    LEGEND,
    PoolRun,
    map_lines,
    no_pool_message,
    totals_line,
    turn_rows,
)
from dctms.tui.screens.base import InspectorScreen
from dctms.tui.widgets.scroll import PageScroll

MAP_WIDTH = 64  # blocks per map line; a pool this small also gets a map per turn in the table
RUN_HINT = (
    "no recorded run: dctms run PLAN --model DIR --conversation FILE.json --report REPORT.json, "
    "then dctms-tui PLAN --run REPORT.json"
)


class PoolScreen(InspectorScreen):
    MODE = "pool"
    TITLE = "Pool"

    def compose_body(self) -> ComposeResult:
        plan, run = self.inspection.plan, self.inspection.pool_run
        with PageScroll(id="pool"):
            yield Static("[b]Prompt-prefix pool[/b]", id="pool-title")
            if plan.bounds.prefix_blocks <= 0:
                yield Static(escape(no_pool_message("This plan")) + ".", id="pool-summary")
                return
            yield Static(escape(pool_label(plan)), id="pool-summary")
            if run is None:
                free = [None] * plan.bounds.prefix_blocks
                yield Static(
                    _map(free, plan.bounds.prefill_chunk, "every block free"), id="pool-map"
                )
                yield Static(f"[dim]{escape(RUN_HINT)}[/dim]", id="pool-turns")
                return
            yield Static(
                _map(run.table, run.block_tokens, f"at the end of {run.name}"),
                id="pool-map",
            )
            yield Static(escape(totals_line(run)), id="pool-totals")
            yield Static(_turns(run), id="pool-turns")


def _map(table: list[int | None], block_tokens: int, when: str) -> Text:
    """The block map, one character a block (free ones dim), with its legend."""
    text = Text.from_markup(f"[b]Blocks[/b] [dim]({escape(when)})[/dim]\n")
    for line in map_lines(table, block_tokens, MAP_WIDTH):
        number, _, drawn = line.partition(" ")
        text.append(f"  {number} ", style="dim")
        for char in drawn:
            text.append(char, style="dim" if char == FREE else "bold cyan")
        text.append("\n")
    text.append(f"  {LEGEND}", style="dim")
    return text


def _turns(run: PoolRun) -> Table:
    per_turn = run.blocks <= MAP_WIDTH
    table = Table(title="Per turn", title_justify="left", box=None, padding=(0, 1))
    for name in ("turn", "prompt", "cached", "hit", "saved", "evicted"):
        table.add_column(name, justify="right")
    if per_turn:
        table.add_column("blocks after")
    for r in turn_rows(run):
        cells = [
            str(r.turn),
            f"{r.prompt_tokens:,}",
            f"{r.cached_tokens:,}",
            str(r.hit),
            str(r.saved),
            str(r.evicted),
        ]
        table.add_row(*cells, *([r.after] if per_turn else []))
    return table
