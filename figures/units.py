"""Byte units: the one size formatter (``human``) and the one size parser (``parse_size``).

Binary units throughout (``1 MiB`` = 2**20 bytes), as MLX reports memory; on input a decimal unit
(``GB``) means what it says and a bare number is bytes.
"""

from __future__ import annotations

import re
from fractions import Fraction

from dctms.schema.errors import DctmsError

KIB = 2**10
MIB = 2**20
GIB = 2**30

_SCALES = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB))
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def human(n: float, digits: int = 2) -> str:
    """``1.50 GiB``, ``390.27 MiB``, ``512 B``: the largest binary unit the value reaches.

    ``digits=1`` gives the short form chart axes use (``390.3 MiB``).
    """
    for unit, scale in _SCALES:
        if abs(n) >= scale:
            return f"{n / scale:,.{digits}f} {unit}"
    return f"{n:.0f} B"  # under 1 KiB: at most four digits


def mib(n: float) -> str:
    """``390.27 MiB`` whatever the size (tables that compare sizes in one unit)."""
    return f"{n / MIB:,.2f} MiB"


def exact_bytes(n: int) -> str:
    """``409,223,296 B (390.27 MiB)``: exact bytes first (the plan's unit), MiB to read at a glance."""
    return f"{n:,} B ({mib(n)})"


def parse_size(text: str) -> int:
    """``"16GiB"`` -> 17179869184; ``"16GB"`` is decimal; a bare number is bytes."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise DctmsError(f"not a size: {text!r} (examples: 16GiB, 512MiB, 8GB, 1000000)")
    # Exact (a Fraction, not a float): 400 nines are out of range, not infinity.
    value = int(Fraction(m.group(1)) * _UNITS[unit])
    if value <= 0 or value > 2**53:
        raise DctmsError(f"size out of range: {text!r}")
    return value
