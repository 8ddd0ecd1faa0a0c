"""``dctms-tui PLAN`` / ``dctms-tui OLD NEW``: the plan inspector (Textual).

Every screen is a Textual *mode*, built the first time it is shown and kept afterwards, so start-up
costs one screen (the Overview, or the Diff in diff mode) however large the plan is.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.reactive import reactive
from textual.screen import ModalScreen, Screen

from dctms.schema.errors import DctmsError
from dctms.schema.io import read_plan
from dctms.schema.ranks import read_rank_plans
from dctms.tui.screens.base import InspectorScreen, PhaseScreen
from dctms.tui.screens.buffers import BuffersScreen
from dctms.tui.screens.diff import DiffScreen
from dctms.tui.screens.help import HelpScreen
from dctms.tui.screens.lifetimes import LifetimesScreen
from dctms.tui.screens.memory import MemoryScreen
from dctms.tui.screens.ops import OpsScreen
from dctms.tui.screens.overview import OverviewScreen
from dctms.tui.screens.pool import PoolScreen
from dctms.tui.screens.schedule import ScheduleScreen
from dctms.tui.state import Inspection

# The screens in number-key order; the Diff screen exists only when two plans are given.
SCREEN_ORDER: tuple[type[InspectorScreen], ...] = (
    OverviewScreen,
    MemoryScreen,
    LifetimesScreen,
    BuffersScreen,
    ScheduleScreen,
    OpsScreen,
    PoolScreen,
    DiffScreen,
)


class InspectorApp(App[int]):
    # Absolute, so a subclass defined elsewhere (tests, embedding) still finds the stylesheet.
    CSS_PATH = Path(__file__).with_name("inspector.tcss")
    TITLE = "dctms-tui"
    ENABLE_COMMAND_PALETTE = True
    # Below 110 columns the Overview stacks its tables instead of placing them side by side.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]

    BINDINGS = [
        Binding("1", "show_number(1)", "screen", key_display=f"1-{len(SCREEN_ORDER)}"),
        *[
            Binding(str(n), f"show_number({n})", f"screen {n}", show=False)
            for n in range(2, len(SCREEN_ORDER) + 1)
        ],
        Binding("tab", "cycle_screen(1)", "next screen", show=False, priority=True),
        Binding("shift+tab", "cycle_screen(-1)", "previous screen", show=False, priority=True),
        Binding("p", "next_phase", "phase"),
        # Only with a folder of rank plans (dctms-tui FOLDER): every screen shows another rank.
        Binding("r", "next_rank(1)", "rank"),
        Binding("R", "next_rank(-1)", "previous rank", show=False),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
    ]

    # The phase the per-phase screens show (index into plan.phases); shared so it survives switching.
    phase: reactive[int] = reactive(0)

    def __init__(
        self, inspection: Inspection, *, screen: str | None = None, exit_after_paint: bool = False
    ):
        super().__init__()
        self.inspection = inspection
        self.exit_after_paint = exit_after_paint
        self.paint_seconds: float | None = None
        self.screen_classes = [
            s for s in SCREEN_ORDER if s is not DiffScreen or inspection.diff_mode
        ]
        for screen_class in self.screen_classes:
            self.add_mode(screen_class.MODE, screen_class)
        self.first_mode = screen or ("diff" if inspection.diff_mode else "overview")
        self.title = f"dctms-tui {inspection.title}"

    def on_mount(self) -> None:
        self.switch_mode(self.first_mode)
        # After the first screen is laid out and drawn: what start-up measurements wait for.
        self.call_after_refresh(self._painted)

    def _painted(self) -> None:
        self.paint_seconds = seconds_since_process_start()
        if self.exit_after_paint:
            self.exit(0)

    # ------------------------------------------------------------------------------- screens

    @property
    def modes(self) -> list[str]:
        return [s.MODE for s in self.screen_classes]

    @property
    def screen_titles(self) -> list[tuple[str, str]]:
        """(mode, title) of this inspection's screens, in number-key order."""
        return [(s.MODE, s.TITLE) for s in self.screen_classes]

    @property
    def absent_screens(self) -> list[tuple[str, str]]:
        """(mode, title) of the screens in number-key order this inspection does not have."""
        return [(s.MODE, s.TITLE) for s in SCREEN_ORDER if s not in self.screen_classes]

    def action_show(self, mode: str) -> None:
        if mode in self.modes:
            self.switch_mode(mode)
        elif mode == "diff":
            self.notify(
                "the Diff screen compares two plans: start it as dctms-tui OLD NEW",
                title="no Diff with one plan",
                severity="warning",
                timeout=10,
            )

    def action_show_number(self, number: int) -> None:
        if 1 <= number <= len(self.modes):
            self.action_show(self.modes[number - 1])
        elif 1 <= number <= len(SCREEN_ORDER) and SCREEN_ORDER[number - 1] is DiffScreen:
            self.action_show(DiffScreen.MODE)  # explains that it needs two plans

    def action_cycle_screen(self, step: int) -> None:
        modes = self.modes
        current = modes.index(self.current_mode) if self.current_mode in modes else 0
        self.switch_mode(modes[(current + step) % len(modes)])

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    # -------------------------------------------------------------------------------- phases

    def action_phase(self, number: int) -> None:
        if 0 <= number < len(self.inspection.plan.phases):
            self.phase = number

    def action_next_phase(self) -> None:
        count = len(self.inspection.plan.phases)
        if count:
            self.phase = (self.phase + 1) % count

    # --------------------------------------------------------------------------------- ranks

    async def action_next_rank(self, step: int) -> None:
        """Every screen shows the next (``step`` 1) or previous (-1) rank's plan: the screens not
        on view are dropped (rebuilt when next shown); the one on view is rebuilt by stepping to
        another screen, dropping it and coming back (a mode's base screen cannot be replaced)."""
        ranks = self.inspection.ranks
        if not ranks or isinstance(self.screen, ModalScreen):
            return
        self.inspection.select_rank((self.inspection.rank + step) % len(ranks))
        self.title = f"dctms-tui {self.inspection.title}"
        if self.phase >= len(self.inspection.plan.phases):
            self.set_reactive(InspectorApp.phase, 0)  # no watcher: the screens are rebuilt below
        current = self.current_mode
        for mode in self.modes:
            if mode != current:
                await self._drop_mode(mode)
        await self.switch_mode(next(m for m in self.modes if m != current))
        await self._drop_mode(current)
        await self.switch_mode(current)

    async def _drop_mode(self, mode: str) -> None:
        """Forget ``mode``'s screen: it is built afresh, from the plan now shown, when next shown."""
        await self.remove_mode(mode)
        self.add_mode(mode, next(s for s in self.screen_classes if s.MODE == mode))

    def watch_phase(self) -> None:
        if isinstance(self.screen, PhaseScreen):
            self.screen.sync_phase()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # "p" only does something (and only shows in the footer) on the per-phase screens.
        if action == "next_phase":
            return isinstance(self.screen, PhaseScreen) and len(self.inspection.plan.phases) > 1
        if action == "next_rank":
            return self.inspection.ranks is not None and not isinstance(self.screen, ModalScreen)
        if action in ("cycle_screen", "show_number", "help"):
            # Not over the help page or the command palette: keys go to them.
            return not isinstance(self.screen, ModalScreen)
        return True

    # ------------------------------------------------------------------------ command palette

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for number, (mode, title) in enumerate(self.screen_titles, start=1):
            yield SystemCommand(
                f"Screen: {title}", f"show the {title} screen (key {number})", self._show(mode)
            )
        for number, phase in enumerate(self.inspection.plan.phases):
            yield SystemCommand(
                f"Phase: {phase.name}",
                f"per-phase screens show {phase.name} ({len(phase.ops):,} ops)",
                self._phase(number),
            )
        yield SystemCommand("Keys: help", "every key of the inspector (?)", self.action_help)
        yield from super().get_system_commands(screen)

    def _show(self, mode: str) -> Callable[[], None]:
        return lambda: self.action_show(mode)

    def _phase(self, number: int) -> Callable[[], None]:
        return lambda: self.action_phase(number)


def seconds_since_process_start() -> float:
    """Seconds since this process started, interpreter start-up and imports included.

    Linux: ``/proc`` uptime minus the process's start tick (10 ms resolution; psutil's create_time
    is derived from a whole-second boot time, too coarse here). Elsewhere: since this module loaded.
    """
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            # Field 22 is the start time in clock ticks; the command name (field 2) may hold spaces.
            start_ticks = int(stat.read().rpartition(")")[2].split()[19])
            now = float(uptime.read().split()[0])
        return now - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line and exit 2, as ``dctms``'s are."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dctms-tui",
        description=(
            "Inspect a dctms plan in the terminal: envelope, memory curve, lifetimes, buffers, "
            "schedule, ops, the prompt-prefix pool (with --run, over a recorded run). With two "
            "plans (OLD NEW) it opens on what changed between them. "
            "With the folder of rank plans dctms compile --ranks wrote, the Overview lists every "
            "rank and r / R shows the next / previous rank's plan on every screen. "
            "An invalid plan is refused with one line on stderr and exit status 2."
        ),
    )
    parser.add_argument(
        "plans",
        nargs="+",
        metavar="PLAN",
        help="a plan file, a folder of rank plans (compile --ranks), or OLD NEW to compare",
    )
    parser.add_argument(
        "--screen",
        choices=[s.MODE for s in SCREEN_ORDER],
        help="screen to open on (default: overview; diff when two plans are given)",
    )
    parser.add_argument(
        "--run",
        metavar="REPORT",
        help=(
            "the report of `dctms run PLAN --conversation FILE --report REPORT`: the Pool screen "
            "draws the plan's prefix pool over that run (blocks, owners, hits, evictions)"
        ),
    )
    parser.add_argument(
        "--exit-after-paint",
        action="store_true",
        help="draw the first screen without a terminal, print the seconds from process start, exit",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.plans) > 2:
        parser.error("give one PLAN, or OLD NEW to compare two plans")
    if args.screen == "diff" and len(args.plans) != 2:
        parser.error("--screen diff needs two plans: OLD NEW")
    if args.run is not None and (len(args.plans) != 1 or Path(args.plans[0]).is_dir()):
        parser.error("--run draws one plan's prefix pool: give one plan file")
    ranks, pool_run = None, None
    try:
        if len(args.plans) == 1 and Path(args.plans[0]).is_dir():  # compile --ranks's folder
            ranks = read_rank_plans(args.plans[0])
            plans = ranks[:1]
        else:
            plans = [read_plan(path) for path in args.plans]
        if args.run is not None:
            from dctms.figures.prefix_run import read_pool_run

            pool_run = read_pool_run(args.run, plans[0], Path(args.plans[0]).name)
    except DctmsError as err:
        print(f"dctms-tui: {err}", file=sys.stderr)
        return err.exit_code
    if ranks is not None:
        inspection = Inspection(ranks[0], args.plans[0], ranks=ranks)
    elif len(plans) == 2:
        inspection = Inspection(plans[1], args.plans[1], old=plans[0], old_path=args.plans[0])
    else:
        inspection = Inspection(plans[0], args.plans[0], pool_run=pool_run)
    app = InspectorApp(inspection, screen=args.screen, exit_after_paint=args.exit_after_paint)
    try:
        app.run(headless=args.exit_after_paint)
    except KeyboardInterrupt:
        return 130
    if args.exit_after_paint and app.paint_seconds is not None:
        print(f"first screen painted {app.paint_seconds:.2f} s after process start")
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main())
