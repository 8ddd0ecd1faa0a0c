"""Whether a plan's M_max fits the ``--memory`` budget it was compiled for, said in one line."""

from __future__ import annotations

from dctms.figures.units import human
from dctms.schema.types import Envelope


def shortfall(env: Envelope) -> str:
    """Why M_max does not fit ``env.device``, exact bytes beside each size; "" when it fits or no
    budget was given."""
    if env.free is None or env.free >= 0:
        return ""
    return (
        f"M_max {human(env.total)} ({env.total:,} B) does not fit the {human(env.device)} "
        f"({env.device:,} B) budget: short by {human(-env.free)} ({-env.free:,} B)"
    )
