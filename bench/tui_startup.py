"""dctms-tui start-up: launch to exit of `dctms-tui qwen7b.plan --exit-after-paint` (first screen
painted, then quit), against a bare Textual app that does the same, in the same run (interleaved,
best of R each, both timed by this script's clock), printed as a ratio.

The bare app pays the interpreter and Textual's own start-up; the ratio is what reading, verifying
and laying out the plan adds. The TUI's own "painted N s after process start" figure is printed too.
Run: .venv/bin/python bench/tui_startup.py [--reps 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "qwen7b.plan"

# A Textual app that exits once its first screen is drawn, timed from process start like the TUI.
BARE_APP = """
from textual.app import App
from textual.widgets import Static
class Bare(App):
    def compose(self):
        yield Static("bare")
    def on_mount(self):
        self.call_after_refresh(lambda: self.exit(0))
Bare().run(headless=True)
"""


def launch_to_exit(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    return time.perf_counter() - start, proc.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    tui = [sys.executable, "-m", "dctms.tui", str(PLAN), "--exit-after-paint"]
    bare = [sys.executable, "-c", BARE_APP]
    tui_times, bare_times, painted = [], [], ""
    for _ in range(args.reps):
        seconds, painted = launch_to_exit(tui)
        tui_times.append(seconds)
        bare_times.append(launch_to_exit(bare)[0])
    best_tui, best_bare = min(tui_times), min(bare_times)
    print(f"last dctms-tui run: {painted}")
    print(f"dctms-tui {PLAN.name}: best {best_tui:.2f} s of {args.reps} "
          f"(all: {', '.join(f'{t:.2f}' for t in tui_times)})")
    print(f"bare Textual app:   best {best_bare:.2f} s of {args.reps} "
          f"(all: {', '.join(f'{t:.2f}' for t in bare_times)})")
    print(f"ratio dctms-tui / bare: {best_tui / best_bare:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
