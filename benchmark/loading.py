"""Which system's weights are loaded first, balanced over the repetitions.

Both systems live in one process (one BLAS, one allocator), and on this machine the copy of the
weights allocated second decodes several per cent faster, whichever system owns it (README,
"Parity"). ``alternate`` (the default) balances that like the call order balances drift: the
runner's copy first on odd repetitions, the baseline's on even ones, both re-loaded between them
(outside any call's time, followed by fresh warm-up calls).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dctms.benchmark.systems import System

RUNNER_FIRST, BASELINE_FIRST, ALTERNATE = "runner-first", "baseline-first", "alternate"
LOAD_ORDERS = (ALTERNATE, RUNNER_FIRST, BASELINE_FIRST)


def first_loaded(order: str, rep: int) -> str:
    """The order the systems are loaded in for repetition ``rep`` (0-based)."""
    if order == ALTERNATE:
        return RUNNER_FIRST if rep % 2 == 0 else BASELINE_FIRST
    return order


class Loaded:
    """The two systems as the protocol calls them, ``[baseline, runner]``, loaded in an order.

    ``systems`` is the list the protocol indexes: a re-load replaces its entries in place, after
    the old systems (and so their weights) are released."""

    def __init__(
        self,
        make_baseline: Callable[[], System],
        make_runner: Callable[[], System],
        order: str,
    ):
        self._make = {"baseline": make_baseline, "runner": make_runner}
        self.order = order
        self.systems: list[System] = []
        self.current: str | None = None
        self.loads = 0

    def load(self, first: str) -> None:
        import mlx.core as mx

        self.systems.clear()  # the old systems' weights are freed before the new ones load
        gc.collect()
        mx.clear_cache()
        made = {}
        for name in ("runner", "baseline") if first == RUNNER_FIRST else ("baseline", "runner"):
            made[name] = self._make[name]()
        self.systems.extend([made["baseline"], made["runner"]])
        self.current = first
        self.loads += 1

    def before_rep(self, rep: int) -> bool:
        """Load (or re-load) for repetition ``rep``; True when the systems were (re)loaded."""
        want = first_loaded(self.order, rep)
        if want == self.current:
            return False
        self.load(want)
        return True

    def describe(self) -> str:
        if self.order == ALTERNATE:
            return (
                "loaded runner first for odd repetitions and baseline first for even ones (both "
                "re-loaded between repetitions, then warmed up again)"
            )
        return "loaded " + ("runner first" if self.order == RUNNER_FIRST else "baseline first")
