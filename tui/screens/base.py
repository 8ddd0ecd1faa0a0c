"""Shared frame of every screen (navigation bar, footer) and the per-phase and search behaviour."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Footer, Input

from dctms.tui.data import PhaseIndex, Query, parse_query
from dctms.tui.widgets.navbar import NavBar, PhaseBar

if TYPE_CHECKING:
    from dctms.tui.app import InspectorApp
    from dctms.tui.state import Session

SEARCH_DELAY_S = 0.3  # typing pauses this long before a large list is filtered again


class InspectorScreen(Screen):
    """A screen of the inspector: ``MODE`` is its mode name (see ``dctms.tui.state.SCREENS``)."""

    MODE: ClassVar[str] = ""

    @property
    def inspector(self) -> InspectorApp:
        return cast("InspectorApp", self.app)

    @property
    def session(self) -> Session:
        return self.inspector.session

    def compose(self) -> ComposeResult:
        yield NavBar(self.session.screens, self.MODE, self.session.title)
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()


class PhaseScreen(InspectorScreen):
    """A screen showing one phase at a time: follows the app's ``phase`` (key ``p``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shown_phase: int | None = None
        self.index: PhaseIndex | None = None

    def compose(self) -> ComposeResult:
        yield NavBar(self.session.screens, self.MODE, self.session.title)
        yield PhaseBar([p.name for p in self.session.plan.phases])
        yield from self.compose_body()
        yield Footer()

    def on_mount(self) -> None:
        self.sync_phase()

    def on_screen_resume(self) -> None:
        # Screens are built once and kept; a phase chosen elsewhere is applied when we come back.
        if self.is_mounted:
            self.sync_phase()

    def sync_phase(self) -> None:
        phase = self.inspector.phase
        if phase == self.shown_phase or not self.session.plan.phases:
            return
        self.shown_phase = phase
        self.index = self.session.index.phase(phase)
        self.query_one(PhaseBar).show_phase(phase, self.phase_note(self.index))
        self.load_phase(self.index)

    def phase_note(self, index: PhaseIndex) -> str:
        p = index.phase
        return (
            f"{p.tokens} token(s) per call, {len(p.ops):,} ops, {len(p.tensors):,} tensors, "
            f"{len(p.slots):,} slots, {len(p.buffers):,} buffers"
        )

    def load_phase(self, index: PhaseIndex) -> None:
        """Fill the screen's widgets for ``index``; subclasses implement it."""


class SearchMixin:
    """``/`` focuses the screen's ``Input#search``; enter applies it, escape returns to ``main``.

    Screens using it define ``apply_search(query)`` and ``main_widget()``.
    """

    SEARCH_BINDINGS = [
        Binding("slash", "search", "search", key_display="/"),
        Binding("escape", "leave_search", "back", show=False),
    ]

    _search_timer: Timer | None = None
    query_text: str = ""

    def action_search(self) -> None:
        self.query_one("#search", Input).focus()  # type: ignore[attr-defined]

    def action_leave_search(self) -> None:
        self.main_widget().focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id != "search":
            return
        if self._search_timer is not None:
            self._search_timer.stop()
        self._search_timer = self.set_timer(  # type: ignore[attr-defined]
            SEARCH_DELAY_S, lambda: self.run_search(event.value)
        )

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "search":
            return
        if self._search_timer is not None:
            self._search_timer.stop()
        self.run_search(event.value)
        self.main_widget().focus()

    def run_search(self, text: str) -> None:
        if text == self.query_text:
            return
        self.query_text = text
        self.apply_search(parse_query(text))

    def apply_search(self, query: Query) -> None:
        raise NotImplementedError

    def main_widget(self) -> Widget:
        raise NotImplementedError
