"""Allocation problems as CSV: ``id,start,end,size[,alignment]`` in, ``id,offset`` out.

Each row is a buffer live over the half-open time range ``[start, end)`` (any integers, only their
order matters) needing ``size`` bytes at an offset that is a multiple of ``alignment`` (the column
is optional; ``default_alignment`` fills it). Columns may come in any order; the header names them.
Every malformed input raises ``DctmsError`` with one line naming the row and the problem.
"""

from __future__ import annotations

import csv
import io
import re

from dctms.schema.errors import DctmsError
from dctms.toolkit.pack.problem import Problem, make_problem

REQUIRED = ("id", "start", "end", "size")
OPTIONAL = ("alignment",)
MAX_TIME = 2**62  # |start|, |end|: sums of two stay inside int64
MAX_SIZE = 2**53  # bytes, the plan format's own bound
MAX_ALIGNMENT = 2**30
# Every buffer's size plus its alignment, summed: no packing's arena can exceed it, so with it
# below 2^62 every offset, top and sum of two stays inside the packers' int64 arrays.
MAX_TOTAL = 2**62
_INTEGER = re.compile(r"[+-]?[0-9]+\Z")


def parse_csv(text: str, source: str, default_alignment: int = 1) -> tuple[list[str], Problem]:
    """The ids (in file order) and the problem of a CSV document."""
    rows = csv.reader(io.StringIO(text))
    try:
        header = next(rows, None)
    except csv.Error as err:
        raise DctmsError(f"{source}: line 1: {err}") from None
    if header is None:
        raise DctmsError(f"{source}: empty file: expected a header {','.join(REQUIRED)}")
    names = [h.strip().lower() for h in header]
    unknown = [n for n in names if n not in REQUIRED + OPTIONAL]
    if unknown:
        raise DctmsError(
            f"{source}: line 1: unknown column {unknown[0]!r} "
            f"(columns: {','.join(REQUIRED)}, optional alignment)"
        )
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        raise DctmsError(f"{source}: line 1: missing column {missing[0]!r}")
    if len(set(names)) != len(names):
        raise DctmsError(f"{source}: line 1: a column is named twice")
    col = {n: names.index(n) for n in names}
    ids: list[str] = []
    seen: set[str] = set()
    starts, ends, sizes, aligns = [], [], [], []
    line = 1
    total = 0
    try:
        for row in rows:
            line = rows.line_num
            if not row or all(not c.strip() for c in row):
                continue  # blank lines are allowed
            if len(row) != len(names):
                raise DctmsError(
                    f"{source}: line {line}: {len(row)} fields, the header has {len(names)}"
                )
            ident = row[col["id"]].strip()
            if not ident:
                raise DctmsError(f"{source}: line {line}: empty id")
            if ident in seen:
                raise DctmsError(f"{source}: line {line}: id {ident!r} appears twice")
            seen.add(ident)
            start = _integer(row[col["start"]], "start", source, line, -MAX_TIME, MAX_TIME)
            end = _integer(row[col["end"]], "end", source, line, -MAX_TIME, MAX_TIME)
            if end <= start:
                raise DctmsError(
                    f"{source}: line {line}: end {end} is not after start {start} "
                    "(the range [start, end) is half-open)"
                )
            size = _integer(row[col["size"]], "size", source, line, 0, MAX_SIZE)
            align = default_alignment
            if "alignment" in col:
                align = _integer(row[col["alignment"]], "alignment", source, line, 1, MAX_ALIGNMENT)
            total += size + align
            if total > MAX_TOTAL:
                raise DctmsError(
                    f"{source}: line {line}: the sizes and alignments up to this row add up to "
                    f"{total} bytes, above 2^62 (offsets and arenas must fit in 64 bits)"
                )
            ids.append(ident)
            starts.append(start)
            ends.append(end)
            sizes.append(size)
            aligns.append(align)
    except csv.Error as err:
        raise DctmsError(f"{source}: line {line}: {err}") from None
    return ids, make_problem(starts, ends, sizes, aligns)


def _integer(text: str, name: str, source: str, line: int, low: int, high: int) -> int:
    value = text.strip()
    if not _INTEGER.match(value) or len(value) > 40:
        raise DctmsError(f"{source}: line {line}: {name} {value[:40]!r} is not an integer")
    number = int(value)
    if not low <= number <= high:
        raise DctmsError(f"{source}: line {line}: {name} {number} is outside [{low}, {high}]")
    return number


def offsets_csv(ids: list[str], offsets: list[int]) -> str:
    """The ``id,offset`` document (quoted where an id needs it)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["id", "offset"])
    writer.writerows(zip(ids, offsets, strict=True))
    return out.getvalue()
