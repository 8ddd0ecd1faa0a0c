"""Top bars: the screens (number keys) and the phases (``p``), both clickable."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


class NavBar(Static):
    """``1 Overview  2 Memory ...`` with the current screen highlighted, the plan name on the right."""

    def __init__(
        self,
        screens: list[tuple[str, str]],
        current: str,
        title: str,
        absent: list[tuple[str, str]] = (),
    ):
        super().__init__(classes="navbar")
        self.screens = screens
        self.current = current
        self.title = title
        self.absent = list(absent)  # (mode, title) of screens this inspection lacks (the Diff)

    def on_mount(self) -> None:
        parts: list[Content | str] = []
        for number, (mode, title) in enumerate(self.screens, start=1):
            label = f" {number} {title} "
            style = "bold reverse " if mode == self.current else ""
            markup = f"[{style}@click=app.show('{mode}')]$label[/]"
            parts.append(Content.from_markup(markup, label=label))
            parts.append(" ")
        for number, (mode, title) in enumerate(self.absent, start=len(self.screens) + 1):
            # Shown dimmed so that its key is not a mystery; choosing it says what it needs.
            markup = f"[dim @click=app.show('{mode}')]$label[/]"
            parts.append(Content.from_markup(markup, label=f" {number} {title} "))
            parts.append(" ")
        parts.append(Content.from_markup("[dim] │ $title[/]", title=self.title))
        self.update(Content.assemble(*parts))


class PhaseBar(Static):
    """``phase: prefill | decode`` with the shown phase highlighted."""

    def __init__(self, phases: list[str]):
        super().__init__(classes="phasebar")
        self.phases = phases

    def show_phase(self, current: int, extra: str = "") -> None:
        parts: list[Content | str] = [Content.from_markup("[dim]phase (p):[/] ")]
        for number, name in enumerate(self.phases):
            style = "bold reverse " if number == current else ""
            markup = f"[{style}@click=app.phase({number})] $name [/]"
            parts.append(Content.from_markup(markup, name=name))
            parts.append(" ")
        if extra:
            parts.append(Content.from_markup("[dim]│[/] $extra", extra=extra))
        self.update(Content.assemble(*parts))
