"""What every screen reads: the plan(s) being inspected and their indexes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dctms.schema.types import Plan
from dctms.tui.data import PlanLookup


@dataclass
class Inspection:
    """The plan the screens show (in diff mode: the new plan) and, in diff mode, the old one."""

    plan: Plan
    path: str
    old: Plan | None = None
    old_path: str | None = None
    index: PlanLookup = field(init=False)

    def __post_init__(self) -> None:
        self.index = PlanLookup(self.plan)

    @property
    def diff_mode(self) -> bool:
        return self.old is not None

    @property
    def title(self) -> str:
        name = Path(self.path).name
        if self.old_path is None:
            return name
        return f"{Path(self.old_path).name} → {name}"
