"""What every screen reads: the plan(s) being inspected and their indexes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dctms.figures.prefix_run import PoolRun
from dctms.schema.types import Plan
from dctms.tui.data import PlanLookup


@dataclass
class Inspection:
    """The plan the screens show (in diff mode: the new plan) and, in diff mode, the old one.

    A folder of rank plans (``dctms compile --ranks``) sets ``ranks``, every rank's plan in rank
    order; ``plan`` is then the plan of rank ``rank``, the one the screens show."""

    plan: Plan
    path: str
    old: Plan | None = None
    old_path: str | None = None
    ranks: list[Plan] | None = None
    rank: int = 0
    pool_run: PoolRun | None = None  # the prefix pool over a recorded run (dctms-tui --run)
    index: PlanLookup = field(init=False)

    def __post_init__(self) -> None:
        if self.ranks is not None:
            self.plan = self.ranks[self.rank]
        self.index = PlanLookup(self.plan)

    def select_rank(self, rank: int) -> None:
        """Show rank ``rank``'s plan (its index is built afresh)."""
        assert self.ranks is not None
        self.rank = rank
        self.plan = self.ranks[rank]
        self.index = PlanLookup(self.plan)

    @property
    def diff_mode(self) -> bool:
        return self.old is not None

    @property
    def title(self) -> str:
        name = Path(self.path).name
        if self.ranks is not None:
            return f"{name}/rank{self.rank}.plan (rank {self.rank} of {len(self.ranks)})"
        if self.old_path is None:
            return name
        return f"{Path(self.old_path).name} → {name}"
