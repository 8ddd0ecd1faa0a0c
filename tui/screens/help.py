"""``?``: every key of the inspector on one page (the footer shows only the most used)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

from dctms.tui.widgets.scroll import PageScroll

KEYS = [
    ("Screens", ""),
    (
        "1 … 8",
        "Overview, Memory, Lifetimes, Buffers, Schedule, Ops, Pool, Diff (dctms-tui OLD NEW)",
    ),
    ("7", "Pool: the prompt-prefix pool's blocks; with --run REPORT, owners, hits and evictions"),
    ("tab / shift+tab", "next / previous screen"),
    ("ctrl+p", "command palette: every screen and phase by name"),
    ("p", "next phase (prefill, decode, …) on the per-phase screens"),
    ("?", "this help;  q: quit"),
    ("Charts (Memory, Lifetimes, Buffers)", ""),
    ("+ / -", "zoom the slot axis in / out;  f: fit every slot"),
    ("← → / h l", "pan along the slots (in tables: scroll the columns)"),
    ("↑ ↓ / k j", "move the row cursor; pgup/pgdn, home/end"),
    ("b", "Lifetimes: one row per tensor ⇄ one row per buffer"),
    ("g", "Lifetimes: group the tensors under a heading per module (again: slot order)"),
    ("[ ]  m", "Memory: step the inspected slot; back to the peak"),
    ("s", "Memory: live tensors largest first (again: smallest first); header clicks sort"),
    ("Tables and search", ""),
    ("/", "search / filter: words match names and primitives; layer:N prim:NAME buf:N kind:K"),
    ("enter", "apply the search and go back to the list"),
    ("escape", "clear the search / filter and go back to the list"),
    ("e", "Schedule: switch between the slots and the sync points"),
]
# Listed after "p" when the inspector opened a folder of rank plans.
RANK_KEYS = [("r / R", "next / previous rank's plan on every screen (a folder of rank plans)")]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,question_mark,q", "app.pop_screen", "close"),
    ]

    def compose(self) -> ComposeResult:
        sections: list[Table] = []
        keys = list(KEYS)
        if getattr(self.app, "inspection", None) and self.app.inspection.ranks is not None:
            after_p = next(i for i, (key, _) in enumerate(keys) if key == "p") + 1
            keys[after_p:after_p] = RANK_KEYS
        for key, what in keys:
            if not what:  # a section heading starts a new table
                sections.append(
                    Table(
                        title=key, title_justify="left", box=None, show_header=False, padding=(0, 2)
                    )
                )
                sections[-1].add_column(style="bold", min_width=16, no_wrap=True)
                sections[-1].add_column()
            else:
                sections[-1].add_row(key, what)
        with PageScroll(id="help"):
            yield Static("[b]dctms-tui keys[/b]")
            for table in sections:
                yield Static(table, classes="help-section")
            yield Static("[dim]escape, ? or q closes this page[/dim]")
