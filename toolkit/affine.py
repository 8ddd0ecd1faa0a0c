"""Affine functions of a phase's lengths, and the places in an op's arguments they fill.

``toolkit.lengths`` fits them; the runner's points are evaluated with them (``toolkit.lengths``,
``toolkit.same_lives``). A leaf of an op's arguments is named by its path of list indices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Affine:
    """value = sum(k[d] * length[d]) + c (fitted by ``toolkit.lengths.fit``)."""

    k: tuple[int, ...]
    c: int


def evaluate(f: Affine, point: Sequence[int]) -> int:
    """``f`` at the lengths ``point``."""
    return sum(k * x for k, x in zip(f.k, point, strict=True)) + f.c


def leaves(value, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], object]]:
    """Every (path, value) of the non-list leaves of nested lists/tuples, in order."""
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from leaves(v, (*path, i))
    else:
        yield path, value


def typed(value: int, as_float: bool) -> int | float:
    """An evaluated place as the trace had it (a float argument stays a float)."""
    return float(value) if as_float else value


def set_leaves(value, changes: dict[tuple[int, ...], object], path: tuple[int, ...] = ()):
    """``value`` with the leaves at the paths of ``changes`` replaced (lists rebuilt as lists)."""
    if path in changes:
        return changes[path]
    if isinstance(value, list | tuple):
        return [set_leaves(v, changes, (*path, i)) for i, v in enumerate(value)]
    return value
