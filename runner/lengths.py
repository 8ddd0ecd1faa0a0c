"""A phase's length points (``Phase.lengths``): which one a call uses, and the arguments there.

The compiler verified every point in ``lengths.points``: at each, every tensor is at most its
planned size with its planned lifetime (``dctms.toolkit.lengths``). The runner therefore runs a call
at the smallest verified point that holds it, and never at any other length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dctms.schema.errors import DctmsError
from dctms.schema.types import Phase


class LengthTable:
    def __init__(self, phase: Phase):
        lengths = phase.lengths
        self.phase = phase.name
        self.names: tuple[str, ...] = tuple(lengths.names) if lengths else ()
        self.bound: tuple[int, ...] = tuple(lengths.bound) if lengths else ()
        # Smallest first: the first point that holds a call is the cheapest one.
        self.points = sorted({tuple(p) for p in lengths.points}) if lengths else [()]
        self._verified = set(self.points)
        self._args: dict[int, list[tuple[tuple[int, ...], tuple[int, ...], int]]] = {}
        self._shapes: dict[str, list[tuple[int, tuple[int, ...], int]]] = {}
        for f in lengths.affine if lengths else []:
            for place in f.at:
                where, _, path = place.partition("/")
                if where[0] == "o":
                    key = tuple(int(x) for x in path.split(".")) if path else ()
                    self._args.setdefault(int(where[1:]), []).append((key, tuple(f.k), f.c))
                elif where[0] in "ti":  # an array-creating op's output, or an input binding
                    self._shapes.setdefault(where[1:], []).append((int(path), tuple(f.k), f.c))

    def pick(self, need: Mapping[str, int]) -> tuple[int, ...]:
        """The smallest verified point with every length >= ``need`` (names this phase does not
        vary are fixed at the bound, which the caller's request must fit)."""
        for point in self.points:
            if all(point[d] >= need.get(name, 0) for d, name in enumerate(self.names)):
                return point
        wanted = ", ".join(f"{k} {v}" for k, v in need.items())
        raise DctmsError(f"{self.phase}: no verified length point holds {wanted}")

    def value(self, point: Sequence[int], name: str, default: int) -> int:
        return point[self.names.index(name)] if name in self.names else default

    def check_point(self, point: tuple[int, ...]) -> None:
        if point not in self._verified:
            raise DctmsError(
                f"{self.phase}: length point {list(point)} is not one the plan verified"
            )

    def args_at(self, index: int, args: list, point: Sequence[int]) -> list:
        """Op ``index``'s arguments at ``point`` (``args`` itself when none depends on lengths)."""
        places = self._args.get(index)
        if not places or tuple(point) == self.bound:
            return args
        out = _copy(args)
        for path, k, c in places:
            value = sum(a * x for a, x in zip(k, point, strict=True)) + c
            _set(out, path, value)
        return out

    def shapes_at(self, outputs: Sequence[str], shapes: tuple, point: Sequence[int]) -> tuple:
        """Shapes at ``point`` where the plan records them (outputs of ops that create an array of a
        given shape, input bindings); ``shapes`` itself otherwise."""
        if tuple(point) == self.bound or not any(t in self._shapes for t in outputs):
            return shapes
        out = [list(s) for s in shapes]
        for j, t in enumerate(outputs):
            for axis, k, c in self._shapes.get(t, []):
                out[j][axis] = sum(a * x for a, x in zip(k, point, strict=True)) + c
        return tuple(tuple(s) for s in out)


def _copy(value):
    return [_copy(v) for v in value] if isinstance(value, list | tuple) else value


def _set(container: list, path: tuple[int, ...], value: int) -> None:
    *head, last = path
    for i in head:
        container = container[i]
    old = container[last]
    container[last] = float(value) if isinstance(old, float) else value
