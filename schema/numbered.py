"""An op together with its index, for readers that pass ops around and still show their number.

Since schema 3 a plan op has no ``index`` field: its index is its position in ``Phase.ops``. Views
that hand single ops to other code (the TUI's screens, the dot renderer) wrap them in ``NumberedOp``,
which reads like the op itself (every ``Op`` field) plus ``index``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dctms.schema.types import Op, Phase


@dataclass(frozen=True)
class NumberedOp:
    index: int  # position in Phase.ops
    op: Op

    def __getattr__(self, name: str) -> Any:  # only called for names not defined here: Op's fields
        return getattr(self.op, name)


def numbered_ops(phase: Phase) -> list[NumberedOp]:
    """The phase's ops in plan order, each with its index."""
    return [NumberedOp(i, op) for i, op in enumerate(phase.ops)]
