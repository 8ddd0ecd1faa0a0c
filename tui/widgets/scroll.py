"""A vertical scroll area that also answers to ``j`` / ``k`` (the Overview and Diff pages)."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import VerticalScroll


class PageScroll(VerticalScroll):
    BINDINGS = [
        Binding("j", "scroll_down", "down", show=False),
        Binding("k", "scroll_up", "up", show=False),
    ]
