"""The length grid a plan's real-length phases run on, as ``show`` and ``diff`` print it."""

from __future__ import annotations

from dctms.schema.types import Phase, Plan

SHOWN = 4  # values printed before the "…" and the last one


def grid_values(phase: Phase) -> dict[str, list[int]]:
    """Per length name, the distinct values of the phase's verified points, ascending."""
    if phase.lengths is None:
        return {}
    names = phase.lengths.names
    return {n: sorted({p[d] for p in phase.lengths.points}) for d, n in enumerate(names)}


def values_text(values: list[int]) -> str:
    """``16, 32, 48, 64, …, 512 (22 values)``; short lists in full."""
    if len(values) <= SHOWN + 1:
        return ", ".join(map(str, values))
    head = ", ".join(map(str, values[:SHOWN]))
    return f"{head}, …, {values[-1]} ({len(values)} values)"


def grid_text(phase: Phase | None) -> str:
    """One line: each length's grid, or why there is none."""
    if phase is None:
        return "no such phase"
    values = grid_values(phase)
    if not values:
        return "fixed (every call padded to the bound)"
    return "; ".join(f"{name} {values_text(v)}" for name, v in values.items())


def grid_steps_text(plan: Plan) -> str:
    """The ``--token-step`` / ``--window-step`` the plan was compiled with ("default" if not given)."""
    request = plan.compile
    if request is None:
        return "not recorded"
    token = request.token_step if request.token_step is not None else "default"
    window = request.window_step if request.window_step is not None else "default"
    return f"--token-step {token}, --window-step {window}"


def grid_brief(phase: Phase | None) -> str:
    """``tokens 16-512 (23), window 16-2048 (92)``: range and count per length (a diff column)."""
    if phase is None:
        return "no such phase"
    values = grid_values(phase)
    if not values:
        return "fixed"
    return ", ".join(f"{name} {v[0]}-{v[-1]} ({len(v)})" for name, v in values.items())
