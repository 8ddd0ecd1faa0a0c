"""Human byte sizes: ``16GiB`` in, ``1.50 GiB`` out (binary units; plain numbers are bytes)."""

from __future__ import annotations

import re
from fractions import Fraction

from dctms.schema.errors import DctmsError

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
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


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


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def human(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"
