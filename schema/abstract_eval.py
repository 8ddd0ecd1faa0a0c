"""A phase evaluated abstractly at one length point: every tensor's shape, and the range of values
an integer tensor can hold, without running anything (no mlx import).

What the runner does at a point (``runner.lengths``) is re-created here from the plan alone: op
arguments and input/creation shapes from ``Phase.lengths``' affine functions, every other shape
inferred from its op the way MLX's own call infers it (the runner's handlers call ``mlx.core``,
which broadcasts elementwise inputs, normalises slices, ...). A shape MLX would refuse is an
``EvalError`` naming the op: that is where the runner would stop with an MLX error.

Value ranges feed the index checks (``rules_index``). A range is ``(lo, hi)`` inclusive, or None
when nothing bounds the values. Per-call inputs get the ranges the runner guarantees
(``input_ranges``); constants their own extremes; the arithmetic MLX does on indices (add,
subtract, multiply, minimum, maximum, remainder, floor division, select, arange, casts, shape-only
ops) keeps a range; anything else gives None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from dctms.schema.fast_ops import FUSED
from dctms.schema.fast_ops import out_shape as fused_shape
from dctms.schema.sizes import ITEMSIZE
from dctms.schema.types import Phase

Shape = tuple[int, ...]
Range = tuple[int, int] | None


class EvalError(Exception):
    """A shape MLX would refuse at this point (the message says which and why); ``op`` is the
    op's position once ``evaluate`` knows it."""

    op: int | None = None
    point: tuple[int, ...] | None = None


@dataclass
class PointPlaces:
    """A phase's affine places at one point: op arguments and tensor/input axes."""

    args: dict[int, list[tuple[tuple[int, ...], int]]] = field(default_factory=dict)
    axes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


def points_of(phase: Phase) -> list[tuple[int, ...] | None]:
    """The points a phase runs at: its verified length points, or None (fixed shapes)."""
    rec = phase.lengths
    if rec is None:
        return [None]
    return [tuple(p) for p in rec.points]


def places_at(
    phase: Phase, point: Sequence[int] | None, parsed: list | None = None
) -> PointPlaces:
    """What the affine functions give at ``point`` (nothing at None: the plan's own values).
    Places that do not parse are the ``lengths`` rule's to report; they are ignored here.
    ``parsed``: ``parse_places(phase)``, when the caller evaluates many points."""
    out = PointPlaces()
    rec = phase.lengths
    if rec is None or point is None:
        return out
    for k, c, args, axes in parse_places(phase) if parsed is None else parsed:
        if len(k) != len(point):
            continue
        value = sum(a * x for a, x in zip(k, point, strict=True)) + c
        for op, key in args:
            out.args.setdefault(op, []).append((key, value))
        for tensor, axis in axes:
            out.axes.setdefault(tensor, []).append((axis, value))
    return out


def parse_places(phase: Phase) -> list[tuple[list[int], int, list, list]]:
    """Per affine function of ``phase.lengths``: its k and c, the op-argument places it fills
    (op index, path) and the tensor or input axes (id, axis); places that do not parse left out."""
    out: list[tuple[list[int], int, list, list]] = []
    if phase.lengths is None:
        return out
    for f in phase.lengths.affine:
        args: list[tuple[int, tuple[int, ...]]] = []
        axes: list[tuple[str, int]] = []
        for place in f.at:
            where, sep, path = place.partition("/")
            if not sep or len(where) < 2:
                continue
            try:
                if where[0] == "o":
                    key = tuple(int(x) for x in path.split(".")) if path else ()
                    args.append((int(where[1:]), key))
                elif where[0] in "ti":
                    axes.append((where[1:], int(path)))
            except ValueError:
                continue
        out.append((f.k, f.c, args, axes))
    return out


def _with(args: list, places: list[tuple[tuple[int, ...], int]]) -> list:
    out = _copy(args)
    for path, value in places:
        if not path:
            continue
        try:
            target = out
            for i in path[:-1]:
                target = target[i]
            old = target[path[-1]]
            target[path[-1]] = float(value) if isinstance(old, float) else value
        except (IndexError, TypeError):
            continue
    return out


def _copy(value):
    return [_copy(v) for v in value] if isinstance(value, list) else value


# ---------------------------------------------------------------------------- shape arithmetic


def broadcast(shapes: Sequence[Shape]) -> Shape:
    """NumPy/MLX broadcasting of ``shapes``; EvalError when they do not broadcast."""
    if all(s == shapes[0] for s in shapes):  # the tracer broadcast them: the usual case
        return shapes[0] if shapes else ()
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(ndim):
        sizes = {s[axis - ndim + len(s)] for s in shapes if axis - ndim + len(s) >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            raise EvalError(f"shapes {' and '.join(map(str, map(list, shapes)))} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _axis(axis: int, ndim: int) -> int:
    if type(axis) is not int or not -ndim <= axis < ndim:
        raise EvalError(f"axis {axis} is outside an array of {ndim} dimensions")
    return axis % ndim


def _ints(value, what: str) -> list[int]:
    if not isinstance(value, list) or any(type(v) is not int for v in value):
        raise EvalError(f"{what} {value!r} is not a list of integers")
    return value


def _slice_shape(shape: Shape, start, stop, strides) -> Shape:
    """The shape ``Slice [start, stop, strides]`` gives; every bound must lie inside the array
    (the plan's slices are MLX's normalised ones: nothing is clamped or wrapped at run time)."""
    start, stop, strides = (_ints(v, "slice bound") for v in (start, stop, strides))
    if not len(start) == len(stop) == len(strides) == len(shape):
        raise EvalError(f"slice {start}:{stop}:{strides} does not match the shape {list(shape)}")
    out = []
    for b, e, s, n in zip(start, stop, strides, shape, strict=True):
        if s == 0:
            raise EvalError("a slice step of 0")
        if s > 0 and not (0 <= b <= n and 0 <= e <= n):
            raise EvalError(f"slice {b}:{e} is outside an axis of size {n}")
        if s < 0 and not (-1 <= e <= b < n):
            raise EvalError(f"slice {b}:{e}:{s} is outside an axis of size {n}")
        out.append(max(0, -(-(e - b) // s)))
    return tuple(out)


def _reshape(shape: Shape, target) -> Shape:
    target = _ints(target, "reshape")
    size = math.prod(shape)
    if target.count(-1) > 1 or any(t < -1 for t in target):
        raise EvalError(f"cannot reshape {list(shape)} to {target}")
    known = math.prod(t for t in target if t != -1)
    if -1 in target:
        if known == 0 or size % known:
            raise EvalError(f"cannot reshape {list(shape)} to {target}")
        target = [size // known if t == -1 else t for t in target]
    if math.prod(target) != size:
        raise EvalError(f"cannot reshape {list(shape)} ({size} elements) to {target}")
    return tuple(target)


_UNARY_OR_BINARY = frozenset(
    "Abs ArcCos ArcCosh ArcSin ArcSinh ArcTan ArcTanh Ceil Conjugate Cos Cosh Erf ErfInv Exp Expm1 "
    "Floor Imag Log1p LogicalNot Negative Real Round Sigmoid Sign Sin Sinh Square StopGradient Tan "
    "Tanh Log Sqrt Add ArcTan2 Divide FloorDivide Greater GreaterEqual Less LessEqual LogAddExp "
    "LogicalAnd LogicalOr Maximum Minimum Multiply NotEqual Power Remainder Subtract BitwiseBinary "
    "DivMod Select Equal AsType AllReduce".split()
)
_SAME_SHAPE = frozenset("Softmax Scan Sort ArgSort Partition ArgPartition".split())


def _out_shapes(
    prim: str, args: list, ins: list[Shape], itemsizes: list[int]
) -> list[Shape] | None:
    """Output shapes of one primitive, or None for a primitive this module does not model."""
    if prim in FUSED:  # mx.fast kernels (schema.fast_ops; the rule fused_kernels checks inputs)
        try:
            return [fused_shape(prim, args, ins)]
        except IndexError:
            raise EvalError(f"{prim} of inputs {[list(s) for s in ins]}") from None
    if prim in _UNARY_OR_BINARY:
        shape = broadcast(ins)
        return [shape, shape] if prim == "DivMod" else [shape]
    x = ins[0] if ins else ()
    if prim in _SAME_SHAPE:
        return [x]
    if prim == "Reduce":
        axes = {_axis(a, len(x)) for a in _ints(args[1], "axes")}
        return [tuple(1 if i in axes else n for i, n in enumerate(x))]
    if prim in ("ArgReduce", "LogSumExp"):
        axis = _axis(args[1] if prim == "ArgReduce" else -1, len(x))
        return [tuple(1 if i == axis else n for i, n in enumerate(x))]
    if prim == "Broadcast":
        target = tuple(_ints(args[0], "shape"))
        if broadcast([x, target]) != target:
            raise EvalError(f"cannot broadcast {list(x)} to {list(target)}")
        return [target]
    if prim == "Reshape":
        return [_reshape(x, args[0])]
    if prim == "Transpose":
        axes = [_axis(a, len(x)) for a in _ints(args[0], "axes")]
        if sorted(axes) != list(range(len(x))):
            raise EvalError(f"{axes} is not a permutation of {len(x)} axes")
        return [tuple(x[a] for a in axes)]
    if prim == "Squeeze":
        axes = {_axis(a, len(x)) for a in _ints(args[0], "axes")}
        if any(x[a] != 1 for a in axes):
            raise EvalError(f"cannot squeeze axes {sorted(axes)} of {list(x)}")
        return [tuple(n for i, n in enumerate(x) if i not in axes)]
    if prim == "ExpandDims":
        axes = _ints(args[0], "axes")
        ndim = len(x) + len(axes)
        where = sorted(_axis(a, ndim) for a in axes)
        out, rest = [], iter(x)
        for i in range(ndim):
            out.append(1 if i in where else next(rest))
        return [tuple(out)]
    if prim == "Flatten":
        a, b = _axis(args[0], len(x)), _axis(args[1], len(x))
        return [(*x[:a], math.prod(x[a : b + 1]), *x[b + 1 :])]
    if prim == "Unflatten":
        axis = _axis(args[0], len(x))
        parts = _reshape((x[axis],), args[1])
        return [(*x[:axis], *parts, *x[axis + 1 :])]
    if prim == "Concatenate":
        axis = _axis(args[0], len(x))
        for s in ins:
            if len(s) != len(x) or any(s[i] != x[i] for i in range(len(x)) if i != axis):
                raise EvalError(f"cannot concatenate {[list(s) for s in ins]} along {axis}")
        return [(*x[:axis], sum(s[axis] for s in ins), *x[axis + 1 :])]
    if prim == "Split":
        axis, cuts = (
            _axis(args[1], len(x)),
            [0, *_ints(args[0], "indices"), x[_axis(args[1], len(x))]],
        )
        if cuts != sorted(cuts):
            raise EvalError(f"split points {cuts[1:-1]} outside an axis of size {x[axis]}")
        return [(*x[:axis], e - b, *x[axis + 1 :]) for b, e in zip(cuts, cuts[1:], strict=False)]
    if prim == "Slice":
        return [_slice_shape(x, *args)]
    if prim == "SliceUpdate":
        region = _slice_shape(x, *args[1:])
        if len(ins) < 2 or broadcast([ins[1], region]) != region:
            raise EvalError(f"an update of shape {list(ins[1:2])} into a slice of {list(region)}")
        return [x]
    if prim == "DynamicSlice":
        sizes = tuple(_ints(args[1], "slice size"))
        if len(sizes) != len(x) or any(not 0 <= s <= n for s, n in zip(sizes, x, strict=True)):
            raise EvalError(f"slice size {list(sizes)} does not fit the shape {list(x)}")
        return [sizes]
    if prim == "DynamicSliceUpdate":
        update = ins[1] if len(ins) > 1 else ()
        if len(update) != len(x) or any(u > n for u, n in zip(update, x, strict=True)):
            raise EvalError(f"an update of shape {list(update)} does not fit the shape {list(x)}")
        return [x]
    if prim == "Pad":
        axes, low, high = (_ints(a, "pad") for a in args[:3])
        out = list(x)
        for a, lo, hi in zip(axes, low, high, strict=True):
            out[_axis(a, len(x))] += lo + hi
            if lo < 0 or hi < 0:
                raise EvalError(f"negative padding {lo}, {hi}")
        return [tuple(out)]
    if prim == "View":
        if not x or len(itemsizes) != 2 or 0 in itemsizes:
            return None
        return [(*x[:-1], x[-1] * itemsizes[0] // itemsizes[1])]
    if prim == "Gather":
        axes, sizes = _ints(args[0], "axes"), tuple(_ints(args[1], "slice sizes"))
        if len(sizes) != len(x) or any(not 0 <= s <= n for s, n in zip(sizes, x, strict=True)):
            raise EvalError(f"slice sizes {list(sizes)} do not fit the shape {list(x)}")
        if len(axes) != len(ins) - 1:
            raise EvalError(f"{len(ins) - 1} index arrays for axes {axes}")
        return [(*broadcast(ins[1:]), *sizes)]
    if prim == "GatherAxis":
        return [ins[1]]
    if prim == "ScatterAxis":
        return [x]
    if prim == "Scatter":  # [reduce, axes]; inputs: the array, one index per axis, the updates
        axes = [_axis(a, len(x)) for a in _ints(args[1], "axes")]
        if len(ins) != len(axes) + 2:
            raise EvalError(f"{len(ins) - 2} index arrays for axes {axes}")
        where = broadcast(ins[1:-1]) if axes else ()
        update = ins[-1]
        sizes = update[len(where) :]
        if update[: len(where)] != where or len(sizes) != len(x):
            raise EvalError(f"updates of shape {list(update)} for indices of shape {list(where)}")
        if any(not 0 <= s <= n for s, n in zip(sizes, x, strict=True)):
            raise EvalError(f"update slices {list(sizes)} do not fit the shape {list(x)}")
        return [x]
    if prim in ("Matmul", "AddMM"):
        a, b = ins[0], ins[1]
        if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
            raise EvalError(f"cannot multiply {list(a)} by {list(b)}")
        out = (*broadcast([a[:-2], b[:-2]]), a[-2], b[-1])
        if prim == "AddMM" and broadcast([ins[2], out]) != out:
            raise EvalError(f"cannot add {list(ins[2])} to {list(out)}")
        return [out]
    if prim == "QuantizedMatmul":
        bits, transpose, w = args[1], args[3], ins[1]
        if type(bits) is not int or bits < 1 or len(w) < 2:
            return None
        inner = w[-1] * 32 // bits if transpose else w[-2]
        if x[-1:] != (inner,):
            raise EvalError(f"cannot multiply {list(x)} by a quantized {list(w)}")
        return [(*x[:-1], w[-2] if transpose else w[-1] * 32 // bits)]
    return None


# ---------------------------------------------------------------------------- value ranges

_INT = ("int", "uint", "bool")


def _is_int(dtype: str) -> bool:
    return dtype.startswith(_INT)


def _dtype_range(dtype: str) -> Range:
    """The values an integer dtype holds (None: not an integer dtype this knows)."""
    if dtype == "bool":
        return 0, 1
    for kind, signed in (("uint", False), ("int", True)):
        if dtype.startswith(kind) and dtype[len(kind) :].isdigit():
            bits = int(dtype[len(kind) :])
            return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return None


def _union(ranges: Sequence[Range]) -> Range:
    if not ranges or any(r is None for r in ranges):
        return None
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _value_range(prim: str, args: list, ranges: list[Range], out_dtype: str) -> Range:
    if not _is_int(out_dtype):
        return None
    if prim in ("Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual",
                "LogicalAnd", "LogicalOr", "LogicalNot"):  # fmt: skip
        return (0, 1)
    if prim in ("Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Broadcast",
                "Transpose", "Slice", "DynamicSlice", "Gather", "GatherAxis", "AsType",
                "StopGradient", "Sort", "Partition", "Copy", "Split", "Concatenate",
                "Depends"):  # fmt: skip
        return _union(ranges[:1] if prim not in ("Concatenate",) else ranges)
    if prim == "Select" and len(ranges) == 3:
        return _union(ranges[1:])
    if prim in ("Minimum", "Maximum") and len(ranges) == 2 and None in ranges:
        # an unknown operand still lies in its dtype (the output's): a clamp bounds the result
        full = _dtype_range(out_dtype)
        ranges = [full if r is None else r for r in ranges]
    if len(ranges) == 2 and ranges[0] is not None and ranges[1] is not None:
        (a, b), (c, d) = ranges
        if prim == "Add":
            return a + c, b + d
        if prim == "Subtract":
            return a - d, b - c
        if prim == "Multiply":
            products = (a * c, a * d, b * c, b * d)
            return min(products), max(products)
        if prim == "Minimum":
            return min(a, c), min(b, d)
        if prim == "Maximum":
            return max(a, c), max(b, d)
        if prim == "Remainder" and c >= 1:  # MLX's integer remainder has the divisor's sign
            return 0, min(d - 1, b) if a >= 0 else d - 1
        if prim == "FloorDivide" and c >= 1:
            return a // d if a >= 0 else a // c, b // c if b >= 0 else b // d
    if prim == "Arange" and len(args) == 3 and all(isinstance(v, int | float) for v in args):
        start, stop, step = args
        count = max(0, math.ceil((stop - start) / step)) if step else 0
        if count == 0 or not all(math.isfinite(v) for v in args):
            return None
        last = start + (count - 1) * step
        return math.floor(min(start, last)), math.ceil(max(start, last))
    return None


# ---------------------------------------------------------------------------- every point


@dataclass
class OpAt:
    """One op at one point: its arguments there, its inputs' shapes and ranges, its outputs'
    shapes. ``point`` is one point where it is so (None: a phase of fixed shapes); ``exact``:
    it is so at the bound, where the plan's recorded shapes are the real ones."""

    position: int
    primitive: str
    args: list
    shapes: list[Shape]
    ranges: list[Range]
    outputs: list[Shape]
    point: tuple[int, ...] | None
    exact: bool
    out_ranges: list[Range]


def evaluate(
    phase: Phase,
    input_ranges: Callable[[tuple[int, ...] | None], dict[str, Range]],
    strict_bound: bool = True,
) -> Iterator[OpAt]:
    """Every op at every point the phase runs at, in plan order (the order the runner creates
    them); EvalError (with ``op`` set) at the first op MLX would refuse. ``input_ranges(point)``:
    per input binding name, what the runner feeds at that point.

    An op is evaluated once per distinct combination of the lengths it depends on (through its
    inputs, its arguments' and outputs' affine places), not once per point: most of a phase does
    not depend on every length, so a 7B plan's 144 points cost a few of its ops' evaluations each.

    ``strict_bound`` False: at the bound, an op MLX would refuse or whose shapes differ from the
    plan's is evaluated on the plan's shapes instead (a plan the runner cannot execute, only
    inspect, need not be MLX's own: the verifier's synthetic plans are not).
    """
    points = points_of(phase)
    bound = tuple(phase.lengths.bound) if phase.lengths is not None else None
    names = len(bound) if bound is not None else 0
    parsed = parse_places(phase)
    places = {p: places_at(phase, p, parsed) for p in points}
    fed = {p: input_ranges(p) for p in points}
    recorded = {t.id: (tuple(t.shape), t.dtype) for t in phase.tensors}
    deps: dict[str, tuple[int, ...]] = {}  # tensor id -> the lengths it depends on
    values: dict[str, dict[tuple, tuple[Shape, Range]]] = {}  # id -> projection -> value
    affine_names = _affine_names(phase, names)
    reps: dict[tuple[int, ...], list[tuple[tuple, tuple[int, ...] | None]]] = {}
    # An op's evaluation is a function of its own fixed parts, its arguments' and outputs' places
    # at the point and its inputs' (shape, range): a model's layers repeat the same ops on the same
    # shapes, so each distinct case is evaluated once (errors are not kept: they are re-raised).
    kinds: dict[tuple, int] = {}
    done: dict[tuple, tuple[list, list]] = {}
    projected: dict[tuple, dict] = {}  # dep -> point -> _project(point, dep)

    def projection(p, dep: tuple[int, ...]) -> tuple:
        table = projected.get(dep)
        if table is None:
            table = projected[dep] = {}
        got = table.get(p)
        if got is None:
            got = table[p] = _project(p, dep)
        return got
    for b in phase.inputs:
        per = {p: (_placed(b.id, tuple(b.shape), places[p]),
                   fed[p].get(b.name) if b.kind == "input" else None) for p in points}  # fmt: skip
        deps[b.id] = _varying(per, names)
        values[b.id] = {_project(p, deps[b.id]): v for p, v in per.items()}
    for c in phase.constants:
        ints = [v for v in c.value if type(v) is int]
        whole = _is_int(c.dtype) and ints and len(ints) == len(c.value)
        deps[c.id] = ()
        values[c.id] = {(): (tuple(c.shape), (min(ints), max(ints)) if whole else None)}
    for k, op in enumerate(phase.ops):
        missing = [t for t in op.inputs if t not in deps]
        if missing:  # the graph rules report it
            raise _at(EvalError(f"reads {missing[0]} before it is made"), k)
        own = set(affine_names.get(f"o{k}", ()))
        for t in (*op.inputs, *op.outputs):
            own |= set(deps.get(t, ())) | set(affine_names.get(f"t{t}", ()))
        dep = tuple(sorted(own))
        for t in op.outputs:
            deps[t], values[t] = dep, {}
        if dep not in reps:  # one point per distinct projection, the first in point order
            reps[dep] = list({_project(p, dep): p for p in reversed(points)}.items())[::-1]
        kind = kinds.setdefault(_fixed_parts(op, recorded), len(kinds))
        for key, p in reps[dep]:
            ins = [values[t][projection(p, deps[t])] for t in op.inputs]
            exact = p is None or key == projection(bound, dep)
            at = places[p]
            case = (
                kind,
                tuple(at.args.get(k, ())),
                tuple(ins),
                tuple(tuple(at.axes.get(t, ())) for t in op.outputs),
            )
            out = done.get(case)
            if out is None:
                try:
                    out = done[case] = _evaluate_op(k, op, at, recorded, ins)
                except EvalError as err:
                    if strict_bound or not exact:
                        raise _at(err, k, p) from None
                    out = (op.args, [(s, None) for s in _recorded(op, recorded)])
            if exact and [s for s, _ in out[1]] != _recorded(op, recorded):
                if strict_bound:
                    found = [list(s) for s, _ in out[1]]
                    raise _at(
                        EvalError(
                            f"makes {found}, the plan records "
                            f"{[list(s) for s in _recorded(op, recorded)]}"
                        ),
                        k,
                        p,
                    )
                out = (
                    out[0],
                    [(s, r) for s, (_, r) in zip(_recorded(op, recorded), out[1], strict=False)],
                )
            for t, v in zip(op.outputs, out[1], strict=True):
                values[t][key] = v
            yield OpAt(k, op.primitive, out[0], [s for s, _ in ins], [r for _, r in ins],
                       [s for s, _ in out[1]], p, exact, [r for _, r in out[1]])  # fmt: skip
        for t in op.outputs:
            deps[t], values[t] = _narrowed(dep, values[t])


def _fixed_parts(op, recorded) -> tuple:
    """What ``_evaluate_op`` reads of an op besides the point's places and its inputs' values:
    its primitive and arguments, and its inputs' and outputs' recorded shapes and dtypes."""
    return (
        op.primitive,
        repr(op.args),
        tuple(recorded.get(t) for t in op.inputs),
        tuple(recorded.get(t) for t in op.outputs),
    )


def _recorded(op, recorded) -> list[Shape]:
    return [recorded.get(t, ((), ""))[0] for t in op.outputs]


def _at(err: EvalError, op: int, point=None) -> EvalError:
    err.op, err.point = op, point
    return err


def _project(point, dep: tuple[int, ...]) -> tuple:
    return () if point is None else tuple(point[d] for d in dep)


def _narrowed(dep: tuple[int, ...], table: dict[tuple, tuple]) -> tuple[tuple[int, ...], dict]:
    """``dep`` without the lengths the values in ``table`` (keyed by ``dep``'s projection) turn
    out not to vary with: an attention output's shape follows the tokens, not the window."""
    for d in reversed(range(len(dep))):
        narrowed: dict[tuple, tuple] = {}
        for key, value in table.items():
            short = key[:d] + key[d + 1 :]
            if narrowed.setdefault(short, value) != value:
                break
        else:
            dep, table = dep[:d] + dep[d + 1 :], narrowed
    return dep, table


def _varying(per: dict, names: int) -> tuple[int, ...]:
    """The lengths a value depends on: none when it is the same at every point, else all."""
    return () if len(set(per.values())) <= 1 else tuple(range(names))


def _affine_names(phase: Phase, names: int) -> dict[str, tuple[int, ...]]:
    """Per place prefix (``o<op>``, ``t<tensor>``), the lengths its affine functions use."""
    out: dict[str, set[int]] = {}
    if phase.lengths is None:
        return {}
    for f in phase.lengths.affine:
        used = {d for d, a in enumerate(f.k) if a} if len(f.k) == names else set(range(names))
        for place in f.at:
            out.setdefault(place.partition("/")[0], set()).update(used)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _evaluate_op(k, op, places: PointPlaces, recorded, ins) -> tuple[list, list]:
    """Op ``k`` at one point from its inputs' (shape, range): its arguments there and its
    outputs' (shape, range)."""
    placed = places.args.get(k)
    args = _with(op.args, placed) if placed else op.args
    shapes_in = [s for s, _ in ins]
    ranges_in = [r for _, r in ins]
    outs = [recorded.get(t, ((), "float32")) for t in op.outputs]
    itemsizes = []
    if op.primitive == "View":  # the input's and the output's item sizes
        first = recorded.get(op.inputs[0]) if op.inputs else None
        itemsizes = [ITEMSIZE.get(d, 0) for d in (first[1] if first else "", outs[0][1])]
    try:
        inferred = (
            None
            if op.primitive in ("Arange", "Full", "Recv")
            else _out_shapes(op.primitive, args, shapes_in, itemsizes)
        )
    except (IndexError, TypeError, ValueError, ZeroDivisionError) as err:
        raise EvalError(f"malformed arguments {args!r}") from err
    if op.primitive == "Arange":
        inferred = [_arange_shape(args)]
        planned = _placed(op.outputs[0], outs[0][0], places) if outs else None
        if inferred[0] != planned:
            raise EvalError(
                f"arange {args} gives {inferred[0][0]} values where the plan has "
                f"{list(planned) if planned is not None else 'no output'}"
            )
    if inferred is None or len(inferred) != len(outs):
        inferred = [_placed(t, s, places) for t, (s, _) in zip(op.outputs, outs, strict=True)]
    result = []
    for s, (_, dtype) in zip(inferred, outs, strict=True):
        result.append((s, _value_range(op.primitive, args, ranges_in, dtype)))
    if op.primitive == "Reduce" and shapes_in and result and ranges_in and ranges_in[0]:
        result[0] = (result[0][0], _reduced_range(args, shapes_in[0], ranges_in[0]))
    if op.primitive in ("ArgReduce", "ArgSort", "ArgPartition") and shapes_in and result:
        # an index along the axis (ArgReduce: [type, axis]; ArgSort: [axis]; ArgPartition:
        # [kth, axis])
        axis = args[0] if op.primitive == "ArgSort" else args[1]
        size = shapes_in[0][_axis(axis, len(shapes_in[0]))]
        result[0] = (result[0][0], (0, max(0, size - 1)))
    return args, result


def _reduced_range(args: list, shape: Shape, r: tuple[int, int]) -> Range:
    """An integer Reduce's range: ``args`` = [type, axes], MLX's Reduce::ReduceType And, Or, Sum,
    Prod, Min, Max; a sum of n values in [a, b] lies in [n a, n b]."""
    kind, axes = args[0], args[1]
    n = math.prod(shape[_axis(a, len(shape))] for a in axes)
    if kind in (0, 1):
        return 0, 1
    if kind == 2:
        return n * r[0], n * r[1]
    if kind in (4, 5):
        return r
    return None


def _arange_shape(args: list) -> Shape:
    if len(args) != 3 or not all(isinstance(v, int | float) for v in args):
        raise EvalError(f"arange arguments {args!r}")
    start, stop, step = args
    if step == 0 or not all(math.isfinite(v) for v in args):
        raise EvalError(f"arange {args}")
    return (max(0, math.ceil((stop - start) / step)),)


def _placed(tensor: str, shape: Shape, places: PointPlaces) -> Shape:
    out = list(shape)
    for axis, value in places.axes.get(tensor, []):
        if 0 <= axis < len(out):
            out[axis] = value
    return tuple(out)
