"""What every screen reads: the plan(s) being inspected and their indexes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dctms.schema.types import Plan
from dctms.tui.data import PlanIndex

# (mode name, title) in number-key order; "diff" exists only when two plans are given.
SCREENS: list[tuple[str, str]] = [
    ("overview", "Overview"),
    ("memory", "Memory"),
    ("lifetimes", "Lifetimes"),
    ("buffers", "Buffers"),
    ("schedule", "Schedule"),
    ("ops", "Ops"),
    ("diff", "Diff"),
]


@dataclass
class Session:
    """The plan the screens show (in diff mode: the new plan) and, in diff mode, the old one."""

    plan: Plan
    path: str
    old: Plan | None = None
    old_path: str | None = None
    index: PlanIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = PlanIndex(self.plan)

    @property
    def diff_mode(self) -> bool:
        return self.old is not None

    @property
    def screens(self) -> list[tuple[str, str]]:
        return [s for s in SCREENS if s[0] != "diff" or self.diff_mode]

    @property
    def title(self) -> str:
        name = Path(self.path).name
        if self.old_path is None:
            return name
        return f"{Path(self.old_path).name} → {name}"
