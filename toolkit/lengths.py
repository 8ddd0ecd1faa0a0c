"""Pass 1b, lengths: one plan, every call at (nearly) its real length.

A phase is traced at its largest lengths -- ``tokens`` (the prompt chunk) and ``window`` (the cache
positions attention reads) -- and planned there. It is also traced at a few smaller lengths. When
every trace has the same graph (same primitives, same inputs and outputs, same constants) and every
number that differs is an integer affine function of the lengths, ``a * tokens + b * window + c``,
the plan records those functions (``Phase.lengths``); the runner then creates the same primitives
with the arguments evaluated at the lengths a call needs.

Why the plan's bound still holds at a smaller length (``README``: "Real-length phases"):

1. same graph: the runner makes one primitive per plan op with the same inputs (the arguments are
   the only difference), so MLX runs them in the plan's order -- its eval order depends on the graph
   only (``toolkit.order``);
2. monotone sizes: every tensor dimension that varies has non-negative coefficients (checked here),
   so at lengths <= the bound every tensor is at most its planned size;
3. same memory behaviour: which op allocates, which output is a view of what, which input is copied
   -- the memory model's decisions -- can depend on sizes (a size-1 axis, equal strides). So the
   compiler re-runs the lifetime pass at every length combination the runner may use
   (``Lengths.points``) and keeps only those where every decision, interval and dispatch count is the
   bound's and every size and scratch is at most the bound's. Then at every slot the live tensors are
   the bound's live tensors, each no larger, and MLX's run-ahead (bounded by dispatches) is the same.

The runner uses only recorded points: the smallest one that holds the call (``runner.lengths``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from dctms.toolkit.affine import Affine, evaluate
from dctms.toolkit.affine import leaves as _leaves
from dctms.toolkit.affine import set_leaves as _set_leaves
from dctms.toolkit.affine import typed as _typed
from dctms.toolkit.lifetimes import CPU_RULES, MemoryRules, PhaseLives, analyse, graph_facts
from dctms.toolkit.parallel import parallel_map
from dctms.toolkit.same_lives import PointChecker
from dctms.toolkit.schedule import Schedule
from dctms.toolkit.trace import TracedBinding, TracedPhase, TracedTensor

TOKENS, WINDOW = "tokens", "window"
ROWS = "rows"  # a batched plan's decode: the slots a step advances (toolkit.slots)
# The default grid steps (``dctms compile --token-step/--window-step``): a prefill chunk is padded
# to a multiple of 16 tokens (prefill is compute-bound: padding costs its share of TTFT), a decode
# window to a multiple of 32 positions (attention over a few spare positions costs far less than
# a decode step's weight reads); both grow by about an eighth beyond 8 steps (``length_grid``).
TOKEN_STEP = 16
WINDOW_STEP = 32


class NotAffine(Exception):
    """The traces differ in a way one plan cannot cover; the message says where."""


@dataclass(frozen=True)
class LengthFit:
    names: tuple[str, ...]
    bound: tuple[int, ...]
    args: dict[tuple[int, tuple[int, ...]], Affine]  # (traced op index, path in args) -> value
    shapes: dict[str, dict[int, Affine]]  # tensor id -> dimension -> size (tensors and bindings)
    floats: frozenset[tuple[int, tuple[int, ...]]]  # the args that are floats in the trace


def length_grid(bound: int, step: int) -> list[int]:
    """The lengths the runner may round a call up to: multiples of ``step`` growing by about an
    eighth (at most ~12.5 % padding beyond ``8 * step``), and the bound itself."""
    values, v = [], step
    while v < bound:
        values.append(v)
        v += max(step, (v // 8) // step * step)
    return [*values, bound]


def sample_lengths(bound: int, avoid: Sequence[int] = ()) -> tuple[int, int] | None:
    """Two smaller lengths to trace at, distinct from the bound and each other and >= 2 (size-1
    axes are special in MLX); None when the bound is too small to vary. ``avoid``: lengths at which
    the traced graph is special (a window equal to a ring's slots makes a broadcast to the same
    shape, which MLX leaves out), each sample moved down past them."""
    a, b = bound // 2, bound // 3
    taken = {bound, *avoid}
    while a in taken:
        a -= 1
    taken.add(a)
    while b in taken:
        b -= 1
    if b < 2 or len({bound, a, b}) < 3:
        return None
    return a, b


@dataclass(frozen=True)
class Digest:
    """What the fit needs of one trace (the phase itself can be dropped: a 7B trace is large)."""

    leaves: list[list[object]]  # per op, its arguments' leaf values in ``_leaves`` order
    shapes: dict[str, tuple[int, ...]]  # tensors and bindings


def digest(ref: TracedPhase, phase: TracedPhase, point: tuple[int, ...]) -> Digest:
    """``phase``'s numbers, after checking it has ``ref``'s graph (NotAffine if not)."""
    if phase is not ref:
        _same_graph(ref, phase, point)
    return Digest([[v for _, v in _leaves(op.args)] for op in phase.ops], _shape_table(phase))


def fit(
    names: Sequence[str],
    samples: Sequence[tuple[tuple[int, ...], TracedPhase | Digest]],
    ref: TracedPhase | None = None,
) -> LengthFit:
    """Fit every differing number to an affine function of the lengths.

    ``samples[0]`` is the bound (``ref``, the phase traced there, when the samples are digests);
    ``samples[1 + d]`` differs from it in length ``d`` only (the basis); the rest are checks that
    the fitted functions must predict exactly."""
    dims = len(names)
    if ref is None:
        ref = samples[0][1]
    digests = [
        (point, d if isinstance(d, Digest) else digest(ref, d, point)) for point, d in samples
    ]
    (bound, _), basis = digests[0], digests[1 : 1 + dims]
    for d, (point, _) in enumerate(basis):
        moved = [i for i in range(dims) if point[i] != bound[i]]
        if moved != [d]:
            raise ValueError(f"basis sample {d} must change length {names[d]} only: {point}")

    def solve(values: list) -> Affine | None:
        """None when every sample has the same value."""
        if all(v == values[0] for v in values):
            return None
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
            raise NotAffine(f"a non-numeric value changes with the lengths: {values[:3]}")
        if any(not math.isfinite(v) or v != int(v) for v in values):
            raise NotAffine(f"a non-integer value changes with the lengths: {values[:3]}")
        v0 = int(values[0])
        k = []
        for d, (point, _) in enumerate(basis):
            q, r = divmod(int(values[1 + d]) - v0, point[d] - bound[d])
            if r:
                raise NotAffine(f"value {values[:3]} is not an integer multiple of {names[d]}")
            k.append(q)
        c = v0 - sum(kd * b for kd, b in zip(k, bound, strict=True))
        f = Affine(tuple(k), c)
        for (point, _), v in zip(digests[1:], values[1:], strict=True):
            if evaluate(f, point) != v:
                raise NotAffine(f"values {values} are not affine in {', '.join(names)}")
        return f

    args: dict[tuple[int, tuple[int, ...]], Affine] = {}
    floats: set[tuple[int, tuple[int, ...]]] = set()
    for i, op in enumerate(ref.ops):
        for j, (path, v) in enumerate(_leaves(op.args)):
            f = solve([dg.leaves[i][j] for _, dg in digests])
            if f is not None:
                args[(i, path)] = f
                if isinstance(v, float):
                    floats.add((i, path))
    shapes: dict[str, dict[int, Affine]] = {}
    tables = [dg.shapes for _, dg in digests]
    for tid, shape in tables[0].items():
        for d in range(len(shape)):
            f = solve([t[tid][d] for t in tables])
            if f is None:
                continue
            if any(k < 0 for k in f.k):
                raise NotAffine(f"tensor {tid} shrinks as {', '.join(names)} grow ({shape})")
            shapes.setdefault(tid, {})[d] = f
    return LengthFit(tuple(names), tuple(bound), args, shapes, frozenset(floats))


def reindexed(lf: LengthFit, new_index: dict[int, int], gone: Collection[str] = ()) -> LengthFit:
    """``lf`` after a graph rewrite: op ``i`` is now op ``new_index[i]`` (ops not in it are gone),
    and the tensors ``gone`` no longer exist."""
    return replace(
        lf,
        args={(new_index[i], p): f for (i, p), f in lf.args.items() if i in new_index},
        shapes={t: dims for t, dims in lf.shapes.items() if t not in gone},
        floats=frozenset((new_index[i], p) for i, p in lf.floats if i in new_index),
    )


def instantiate(phase: TracedPhase, lf: LengthFit, point: Sequence[int]) -> TracedPhase:
    """The phase as the runner will build it at ``point``: arguments and shapes evaluated."""
    values: dict[Affine, int] = {}  # a fit has few distinct functions and thousands of places

    def value(f: Affine) -> int:
        v = values.get(f)
        if v is None:
            v = values[f] = evaluate(f, point)
        return v

    def shape(tid: str, old: tuple[int, ...]) -> tuple[int, ...]:
        dims = lf.shapes[tid]
        return tuple(value(dims[d]) if d in dims else n for d, n in enumerate(old))

    # Only the ops, tensors and bindings the fit names change; the rest are the bound's, shared.
    by_op: dict[int, dict[tuple[int, ...], int | float]] = {}
    for (i, path), f in lf.args.items():
        by_op.setdefault(i, {})[path] = _typed(value(f), (i, path) in lf.floats)
    ops = list(phase.ops)
    for i, changes in by_op.items():
        ops[i] = replace(ops[i], args=_set_leaves(ops[i].args, changes))
    tensors = dict(phase.tensors)
    for t in lf.shapes:
        x = tensors.get(t)
        if x is not None:
            tensors[t] = TracedTensor(t, shape(t, x.shape), x.dtype)

    def bindings(bs: list[TracedBinding]) -> list[TracedBinding]:
        return [replace(b, shape=shape(b.id, b.shape)) if b.id in lf.shapes else b for b in bs]

    return replace(
        phase,
        tokens=point[lf.names.index(TOKENS)] if TOKENS in lf.names else phase.tokens,
        inputs=bindings(phase.inputs),
        outputs=bindings(phase.outputs),
        ops=ops,
        tensors=tensors,
    )


def verified_points(
    phase: TracedPhase,
    lf: LengthFit,
    sched: Schedule,
    bound_lives: PhaseLives,
    candidates: Sequence[tuple[int, ...]],
    rules: MemoryRules = CPU_RULES,
    jobs: int | None = None,
) -> tuple[list[tuple[int, ...]], list[str]]:
    """The candidates at which the lifetime pass gives the bound's decisions with sizes no larger
    (point 3 of the module docstring), the bound first; and why each other one was dropped.
    The points are independent: ``jobs`` processes check them (``toolkit.parallel``)."""
    todo = [tuple(p) for p in candidates if tuple(p) != lf.bound]
    facts = graph_facts(phase, sched, rules)  # the same at every point: lengths change sizes only
    # Most points are proven by replaying pass 3's decisions (toolkit.same_lives); pass 3 itself
    # runs only at the others, where it decides (and words why a point is left out).
    checker = PointChecker(phase, lf, sched, bound_lives, rules, facts) if todo else None
    proven = [checker is not None and checker.same_lives(p) for p in todo]
    rest = [p for p, ok in zip(todo, proven, strict=True) if not ok]
    work = (phase, lf, sched, bound_lives, rules, facts)
    why_not = dict(zip(rest, parallel_map(_why_not, work, rest, jobs), strict=True))
    kept, dropped = [lf.bound], []
    for point in todo:
        why = why_not.get(point, "")
        if why:
            dropped.append(f"{point}: {why}")
        else:
            kept.append(point)
    return kept, dropped


def _why_not(work: tuple, point: tuple[int, ...]) -> str:
    phase, lf, sched, bound_lives, rules, facts = work
    return _differs(bound_lives, analyse(instantiate(phase, lf, point), sched, rules, facts))


def prefill_candidates(
    token_bound: int, window_bound: int, input_tokens: int, token_step: int = TOKEN_STEP
) -> list[tuple[int, int]]:
    """(tokens, window) pairs the runner's chunking needs: a chunk of t tokens (t on the grid) at
    position k * chunk attends over k * chunk + t positions; (t, window bound) as a fallback."""
    chunks = math.ceil(input_tokens / token_bound)
    points = set()
    for t in length_grid(token_bound, token_step):
        for k in range(chunks):
            w = k * token_bound + t
            if w <= window_bound:
                points.add((t, w))
        points.add((t, window_bound))
    return sorted(points)


def sample_rows(bound: int) -> tuple[int, int] | None:
    """Two row counts to trace a batched decode at besides the bound: >= 2 (size-1 axes are
    special in MLX) and below it, distinct where the bound leaves room (B = 3: rows 2 twice, the
    second trace checking the window's coefficient at other rows); None for B = 2."""
    below = list(range(2, bound))
    if not below:
        return None
    return below[len(below) // 2], below[0]


def rows_candidates(
    rows_bound: int, window_bound: int, window_step: int = WINDOW_STEP
) -> list[tuple[int, int]]:
    """(rows, window) pairs of a batched decode: the row counts of ``rows_grid``, at every window
    of the grid (a step attends over the longest busy sequence's positions)."""
    windows = length_grid(window_bound, window_step)
    return [(r, w) for r in rows_grid(rows_bound) for w in windows]


def rows_grid(bound: int) -> list[int]:
    """The row counts a batched decode step may run at: powers of two, and the plan's slots. A
    step of r busy rows runs at the smallest of them >= r (at most twice the rows it needs); every
    row count would multiply the points the compiler verifies by the slots (a 1.5B model's
    8-slot plan: 7 x 27 windows), for a step cost that grows far slower than its rows."""
    values, r = [], 1
    while r < bound:
        values.append(r)
        r *= 2
    return [*values, bound]


def single_candidates(
    name: str, bound: int, token_step: int = TOKEN_STEP, window_step: int = WINDOW_STEP
) -> list[tuple[int]]:
    """The grid of a phase with one length (decode: the window)."""
    return [(v,) for v in length_grid(bound, token_step if name == TOKENS else window_step)]


# --------------------------------------------------------------------------------------- helpers


def _differs(ref: PhaseLives, got: PhaseLives) -> str:
    if set(ref.lives) != set(got.lives):
        return "other tensors own memory"
    for tid, a in ref.lives.items():
        b = got.lives[tid]
        if (a.kind, a.root, a.start, a.end, a.scratch_of) != (
            b.kind,
            b.root,
            b.start,
            b.end,
            b.scratch_of,
        ):
            return f"tensor {tid} is a {b.kind} of {b.root} over [{b.start}, {b.end}] (bound: {a.kind} of {a.root} over [{a.start}, {a.end}])"
        if b.bytes > a.bytes:
            return f"tensor {tid} is larger than at the bound"
    if ref.slot_interval != got.slot_interval:
        return "other slot intervals"
    if ref.dispatches != got.dispatches:
        return "other dispatch counts"
    if any(b > a for a, b in zip(ref.scratch, got.scratch, strict=True)):
        return "more scratch than at the bound"
    return ""


def _same_graph(ref: TracedPhase, other: TracedPhase, point: tuple[int, ...]) -> None:
    where = f"traced at {point}"
    if len(ref.ops) != len(other.ops):
        raise NotAffine(f"{where}: {len(other.ops)} primitives, {len(ref.ops)} at the bound")
    for i, (a, b) in enumerate(zip(ref.ops, other.ops, strict=True)):
        if (a.primitive, a.inputs, a.outputs) != (b.primitive, b.inputs, b.outputs):
            raise NotAffine(f"{where}: op {i} is {b.primitive}, {a.primitive} at the bound")
        if _structure(a.args) != _structure(b.args):
            raise NotAffine(f"{where}: op {i} ({a.primitive}) has other arguments")
    for what, xs, ys in (
        ("input", ref.inputs, other.inputs),
        ("output", ref.outputs, other.outputs),
    ):
        if [_binding_key(x) for x in xs] != [_binding_key(y) for y in ys]:
            raise NotAffine(f"{where}: other {what}s")
    if [(c.id, c.shape, c.dtype, c.value) for c in ref.constants] != [
        (c.id, c.shape, c.dtype, c.value) for c in other.constants
    ]:
        raise NotAffine(f"{where}: other constants")
    if {t: (x.dtype, len(x.shape)) for t, x in ref.tensors.items()} != {
        t: (x.dtype, len(x.shape)) for t, x in other.tensors.items()
    }:
        raise NotAffine(f"{where}: other tensors")


def _binding_key(b: TracedBinding) -> tuple:
    return (b.id, b.kind, b.name, b.dtype, len(b.shape))


def _shape_table(phase: TracedPhase) -> dict[str, tuple[int, ...]]:
    table = {t: x.shape for t, x in phase.tensors.items()}
    for b in [*phase.inputs, *phase.outputs]:
        table.setdefault(b.id, b.shape)
    return table


def _structure(value) -> object:
    if isinstance(value, list | tuple):
        return [_structure(v) for v in value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value  # strings, dtypes, ... must be equal
    return "#"
