"""Where dctms keeps what it makes once per machine: ``$XDG_CACHE_HOME/dctms``, else
``~/.cache/dctms`` (the demo model, the benchmark's model, the compiler's packings)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """dctms's cache: ``$XDG_CACHE_HOME/dctms``, else ``~/.cache/dctms``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dctms"
