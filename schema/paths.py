"""JSON paths for problem reports: ``$.phases[0].tensors[3].interval``."""

from __future__ import annotations

import re
from collections.abc import Iterable

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def json_path(parts: Iterable[str | int]) -> str:
    """The JSON path of a location given as keys and list indices from the document root."""
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _IDENTIFIER.match(part):
            out += f".{part}"
        else:
            out += "[" + _quote(part) + "]"
    return out


def _quote(key: str) -> str:
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    # Keep the path on one line whatever the key holds.
    escaped = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped)
    return f'"{escaped}"'
