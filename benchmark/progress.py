"""A plain-text progress bar on stderr (no dependencies).

On a terminal the bar redraws in place (``\\r``); elsewhere (pipes, CI logs) it prints a line at
every tenth of the run, so logs stay short."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 24


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class ProgressBar:
    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True):
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.perf_counter()
        self._last_tenth = -1
        self._drawn = False

    def line(self, done: int, label: str) -> str:
        frac = min(done / self.total, 1.0)
        filled = int(round(frac * WIDTH))
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (self.total - done) if done else 0.0
        return (
            f"bench [{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{self.total} "
            f"{label}  elapsed {_clock(elapsed)}  eta {_clock(eta)}"
        )

    def update(self, done: int, label: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line(done, label))
            self._drawn = True
        else:
            tenth = done * 10 // self.total
            if tenth == self._last_tenth and done != self.total:
                return
            self._last_tenth = tenth
            self.stream.write(self.line(done, label) + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A message that does not garble the bar."""
        if not self.enabled:
            return
        if self._drawn:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
