"""Progress lines on stderr for the long commands (compile, convert-gguf): elapsed seconds and a
message, shown on a terminal or with --progress, never with --quiet."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable


def progress_printer(args: argparse.Namespace) -> Callable[[str], None]:
    start = time.perf_counter()
    show = not args.quiet and (args.progress or sys.stderr.isatty())

    def progress(msg: str) -> None:
        if show:
            print(f"[{time.perf_counter() - start:6.2f}s] {msg}", file=sys.stderr)

    return progress
