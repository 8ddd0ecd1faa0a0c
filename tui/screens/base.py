"""Shared frame of every screen (navigation bar, footer) and the per-phase and search behaviour."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Footer, Input

from dctms.figures.vision import phase_labels
from dctms.tui.data import PhaseLookup, Query, parse_query
from dctms.tui.widgets.navbar import NavBar, PhaseBar

if TYPE_CHECKING:
    from dctms.tui.app import InspectorApp
    from dctms.tui.state import Inspection

SEARCH_DELAY_S = 0.3  # typing pauses this long before a large list is filtered again


class InspectorScreen(Screen):
    """A screen of the inspector: ``MODE`` is its mode name, ``TITLE`` its name in the navigation bar
    (the order is ``dctms.tui.app.SCREEN_ORDER``)."""

    MODE: ClassVar[str] = ""
    TITLE: ClassVar[str] = ""

    @property
    def inspector(self) -> InspectorApp:
        return cast("InspectorApp", self.app)

    @property
    def inspection(self) -> Inspection:
        return self.inspector.inspection

    def compose(self) -> ComposeResult:
        yield self.nav_bar()
        yield from self.compose_body()
        yield Footer()

    def nav_bar(self) -> NavBar:
        app = self.inspector
        return NavBar(app.screen_titles, self.MODE, self.inspection.title, app.absent_screens)

    def compose_body(self) -> ComposeResult:
        yield from ()


class PhaseScreen(InspectorScreen):
    """A screen showing one phase at a time: follows the app's ``phase`` (key ``p``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shown_phase: int | None = None
        self.index: PhaseLookup | None = None

    def compose(self) -> ComposeResult:
        yield self.nav_bar()
        yield PhaseBar(phase_labels(self.inspection.plan))  # with its stream in a VLM plan
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
        if phase == self.shown_phase or not self.inspection.plan.phases:
            return
        self.shown_phase = phase
        self.index = self.inspection.index.phase(phase)
        self.query_one(PhaseBar).show_phase(phase, self.phase_note(self.index))
        self.load_phase(self.index)

    def phase_note(self, index: PhaseLookup) -> str:
        p = index.phase
        return (
            f"{p.tokens} token(s) per call, {len(p.ops):,} ops, {len(p.tensors):,} tensors, "
            f"{len(p.slots):,} slots, {len(p.buffers):,} buffers"
        )

    def load_phase(self, index: PhaseLookup) -> None:
        """Fill the screen's widgets for ``index``; subclasses implement it."""


class SearchScreen(PhaseScreen):
    """A per-phase screen with a search box: ``/`` focuses it, enter applies it, escape returns to
    ``main_widget()``. Subclasses set ``SEARCH_PLACEHOLDER``, yield ``search_box()`` in
    ``compose_body`` and define ``apply_search(query)`` and ``main_widget()``.
    """

    BINDINGS = [
        Binding("slash", "search", "search", key_display="/"),
        Binding("escape", "leave_search", "back", show=False),
    ]
    SEARCH_PLACEHOLDER: ClassVar[str] = "/ search"

    _search_timer: Timer | None = None
    query_text: str = ""

    def search_box(self) -> Input:
        return Input(placeholder=self.SEARCH_PLACEHOLDER, id="search")

    def action_search(self) -> None:
        self.query_one("#search", Input).focus()

    def action_leave_search(self) -> None:
        """Escape: the search box emptied and its filter dropped, back to the list."""
        if self._search_timer is not None:
            self._search_timer.stop()
        box = self.query_one("#search", Input)
        if box.value:
            box.value = ""
        self.run_search("")
        self.main_widget().focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id != "search":
            return
        if self._search_timer is not None:
            self._search_timer.stop()
        self._search_timer = self.set_timer(SEARCH_DELAY_S, lambda: self.run_search(event.value))

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
