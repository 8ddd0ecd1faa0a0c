"""The project's own error types: every bad input ends in one of these, never a traceback."""

from __future__ import annotations

from dataclasses import dataclass


def short_value(value: object) -> str:
    """``value`` for a one-line message: at most 40 characters (a 400-digit number is cut)."""
    if type(value) is int and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class DctmsError(Exception):
    """A problem with the user's input. The CLI prints ``str(err)`` on one line and exits 2."""

    exit_code = 2


@dataclass(frozen=True)
class Problem:
    """One verifier finding: ``path`` is a JSON path into the plan (``$.phases[0].tensors[3]``)."""

    path: str
    message: str
    rule: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"

    def line(self, source: str) -> str:
        """``SOURCE: PATH: MESSAGE`` on one line; the path is left out when it is the whole file."""
        where = "" if self.path == "$" else f"{self.path}: "
        return _printable(f"{source}: {where}{self.message}")


def _printable(text: str) -> str:
    # A value quoted in a message may hold a newline or a control character: escaped, the line
    # stays one line.
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class PlanError(DctmsError):
    """A plan that cannot be read or is not valid; ``problems`` lists every finding."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        first = problems[0] if problems else Problem("$", "invalid plan")
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(first.line(source) + more)


class OverBudgetError(DctmsError):
    """A compiled plan whose M_max does not fit the memory budget it was compiled for (the CLI
    writes it all the same and exits 1); ``plan`` is that plan, ``str(err)`` the shortfall."""

    exit_code = 1

    def __init__(self, message: str, plan: object):
        self.plan = plan
        super().__init__(message)


class InternalError(DctmsError):
    """A bug in dctms itself (e.g. the compiler produced a plan its own verifier rejects)."""

    exit_code = 70  # EX_SOFTWARE
