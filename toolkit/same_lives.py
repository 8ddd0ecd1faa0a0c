"""Pass 3's decisions replayed at a length point: the fast proof that a point keeps the bound's lives.

``toolkit.lengths`` keeps a length point when pass 3 (``lifetimes.analyse``) at that point gives the
bound's decisions with sizes no larger. Re-running pass 3 per point costs a 7B phase ~50 ms (144
points: seconds). This module decides the same question from what pass 3's result *depends on*:

``analyse`` walks the ops in execution order; the only things it computes from sizes or layouts are
each op's cost (``lifetimes.op_cost``: its outputs' effect kinds, sources, copies kept alive, donor
candidates, scratch and dispatches), the donor it picks (``_donatable``: the graph, the lives made so far and one
size comparison) and the byte sizes. Everything else -- which tensors own memory, their roots, the
reads that end lifetimes, the run-ahead widening -- follows from those decisions and the graph. So,
by induction over the ops: when at every op the point's decisions equal the bound's, the lives made
before it are the bound's (same kinds, roots, donated set), hence its input ``is state`` flags and
donation candidates are the bound's, and pass 3 at the point takes exactly the bound's branches.
Its result then differs from the bound's only in sizes and layouts; with every scratch and every
varying dimension at most the bound's (and not negative), ``lengths._differs`` finds nothing.

:meth:`PointChecker.same_lives` answers True only in that case. False means "not proven here", and
the caller runs pass 3 itself (the complete check, which also words the reason). Both compute an
op's cost with the same function (``lifetimes.op_cost``), memoised here by everything it reads
(primitive, arguments, input layouts, dtypes, output shapes, state flags): a model's layers repeat,
and most ops are the same at many points. The induction's base is checked, not assumed: the lives
given must be pass 3's at the bound, and the replay at the bound must give their scratch,
dispatches and kinds; otherwise the checker proves nothing and every point goes to pass 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import TYPE_CHECKING

from dctms.schema.aliasing import DONATION_SLACK_BYTES
from dctms.schema.sizes import ITEMSIZE
from dctms.toolkit.affine import evaluate, set_leaves, typed
from dctms.toolkit.lifetimes import GraphFacts, MemoryRules, PhaseLives, analyse, op_cost
from dctms.toolkit.memory_model import Layout, donated_layout, row_major
from dctms.toolkit.schedule import Schedule
from dctms.toolkit.trace import TracedPhase

if TYPE_CHECKING:  # lengths imports this module
    from dctms.toolkit.lengths import LengthFit


class PointChecker:
    """The bound's decisions of one phase, and :meth:`same_lives` to compare a point's with them."""

    def __init__(
        self,
        phase: TracedPhase,
        lf: LengthFit,
        sched: Schedule,
        bound_lives: PhaseLives,
        rules: MemoryRules,
        facts: GraphFacts,
    ) -> None:
        self.lf = lf
        self.rules = rules
        # The induction starts from pass 3's own result at the bound: lives given for anything
        # else (another phase's, other rules') prove nothing, and every point goes to pass 3.
        self._sound = analyse(phase, sched, rules, facts) == bound_lives
        if not self._sound:
            return
        lives = bound_lives.lives
        # Tensor numbering: op outputs and intermediates, then the leaves (inputs, constants).
        index: dict[str, int] = {}
        for t in phase.tensors:
            index[t] = len(index)
        for b in phase.inputs:
            index.setdefault(b.id, len(index))
        for c in phase.constants:
            index.setdefault(c.id, len(index))
        size = len(index)
        self._dtype: list[str] = [""] * size
        for t, x in phase.tensors.items():
            self._dtype[index[t]] = x.dtype

        # The affine functions the point evaluates, each once.
        funcs: dict = {}

        def fid(f) -> int:
            return funcs.setdefault(f, len(funcs))

        # Shapes: a tensor's bound shape, and (varying ones) a template of evaluated dims.
        self._bound_shapes: list[tuple[int, ...] | None] = [None] * size
        for t, x in phase.tensors.items():
            self._bound_shapes[index[t]] = x.shape
        templates: dict[tuple, int] = {}
        self._tensor_templates: list[tuple[int, int]] = []  # (tensor index, template)

        def template(old: tuple[int, ...], dims: dict) -> int:
            key = tuple((fid(dims[d]), None) if d in dims else (None, n) for d, n in enumerate(old))
            return templates.setdefault(key, len(templates))

        for t, x in phase.tensors.items():
            dims = lf.shapes.get(t)
            if dims:
                self._tensor_templates.append((index[t], template(x.shape, dims)))
        # Leaves: their layouts (row-major at their shape at the point), as ``analyse`` makes them.
        self._leaves: list[tuple[int, tuple[int, ...], int | None]] = []
        for b in phase.inputs:
            dims = lf.shapes.get(b.id)
            self._leaves.append((index[b.id], b.shape, template(b.shape, dims) if dims else None))
        for c in phase.constants:
            self._leaves.append((index[c.id], c.shape, None))
        self._templates = list(templates)

        # Per execution position: what op_memory reads, and the bound's decisions.
        leaf_kind = {b.id: b.kind for b in phase.inputs}
        leaf_kind.update({c.id: "constant" for c in phase.constants})

        def root_of(t: str) -> str:
            life = lives.get(t)
            return life.root if life is not None and life.kind in ("view", "state") else t

        by_op: dict[int, list[tuple[tuple[int, ...], int, bool]]] = {}
        for (i, path), f in sorted(lf.args.items()):
            by_op.setdefault(i, []).append((path, fid(f), (i, path) in lf.floats))
        signatures: dict[tuple, int] = {}
        self._ops = []
        for pos, i in enumerate(sched.order):
            op = phase.ops[i]
            is_state = tuple(leaf_kind.get(root_of(t)) == "state" for t in op.inputs)
            varying = tuple(by_op.get(i, ()))
            eligible = len(op.outputs) == 1 and op.outputs[0] not in facts.held
            signature = (
                eligible,
                op.primitive,
                repr(op.args) if not varying else None,
                tuple(facts.in_dtypes[pos]),
                tuple(facts.out_dtypes[pos]),
                is_state,
            )
            sig = signatures.setdefault(signature, len(signatures))
            self._ops.append(
                (
                    sig,
                    varying,
                    tuple(index[t] for t in op.inputs),
                    tuple(index[t] for t in op.outputs),
                    eligible,
                    op,
                    pos,
                    is_state,
                )
            )
        self._funcs = list(funcs)
        self._facts = facts
        # What ``_donatable`` reads of the lives made before an op, fixed by the bound's decisions
        # (equal at the point, by the induction of the module docstring): per tensor that may be
        # donated at all (a candidate that owns its buffer), its segment and the tensor whose
        # bytes the slack compares. Owners by allocation here; donated outputs (which own their
        # donor's buffer) are added by the bound's own run below, as it makes them.
        self._index = index
        self._lives = lives
        self._donor_info: dict[int, tuple[int, int]] = {}
        for t, life in lives.items():
            if t in facts.donors and life.kind == "intermediate" and life.root is None:
                self._donor_info[index[t]] = (facts.segment_end[life.start], index[t])
        self._ids = list(index)
        self._memo: dict[tuple, tuple] = {}  # op_memory's decisions by everything it reads
        self._donated: dict[tuple, int] = {}  # (donor layout, shape) -> the output's layout
        self._layouts: list[Layout] = []
        self._layout_id: dict[Layout, int] = {}
        self._bound = self._decisions(lf.bound, None)
        # The replay must be pass 3's own at the bound: its scratch, dispatches and every output's
        # kind (a code path of ``analyse`` the replay lacked would show here first).
        self._sound = self._replays(bound_lives)

    def _replays(self, bound_lives: PhaseLives) -> bool:
        if [b[1] for b in self._bound] != bound_lives.scratch:
            return False
        if [b[0][2] for b in self._bound] != bound_lives.dispatches:
            return False
        lives, ids = bound_lives.lives, self._ids
        for (decision, _, donor), op in zip(self._bound, self._ops, strict=True):
            for t, (kind, _, _) in zip(op[3], decision[0], strict=True):
                if donor is not None or kind == "view":
                    want = ("view",)
                elif kind == "inplace":
                    want = ("state",)
                else:
                    want = ("output", "intermediate")
                if lives[ids[t]].kind not in want:
                    return False
        return True

    def same_lives(self, point: Sequence[int]) -> bool:
        """True only when pass 3 at ``point`` keeps the bound's lives (module docstring)."""
        if not self._sound:
            return False
        if any(not 0 <= evaluate(f, point) <= evaluate(f, self.lf.bound) for f in self._funcs):
            return False  # a varying size above the bound's (or negative): let pass 3 say
        return self._decisions(point, self._bound) is not None

    # --------------------------------------------------------------------------------- internals

    def _lid(self, layout: Layout) -> int:
        got = self._layout_id.get(layout)
        if got is None:
            got = self._layout_id[layout] = len(self._layouts)
            self._layouts.append(layout)
        return got

    def _decisions(self, point: Sequence[int], bound: list | None) -> list | None:
        """The per-op decisions at ``point``; with ``bound`` (the bound's), None at the first op
        whose decisions differ from it."""
        values = [evaluate(f, point) for f in self._funcs]
        made = [tuple(values[f] if f is not None else n for f, n in key) for key in self._templates]
        shapes = list(self._bound_shapes)
        for t, k in self._tensor_templates:
            shapes[t] = made[k]
        layout: list[int | None] = [None] * len(shapes)
        for t, old, k in self._leaves:
            layout[t] = self._lid(row_major(made[k] if k is not None else old))
        memo, rules, dtype = self._memo, self.rules, self._dtype
        donated, donor_info, segment_end = self._donated, self._donor_info, self._facts.segment_end
        out: list = []
        for sig, varying, ins, outs, eligible, op, pos, is_state in self._ops:
            values_here = tuple(typed(values[f], fl) for _, f, fl in varying) if varying else ()
            key = (sig, values_here, *[layout[t] for t in ins], *[shapes[t] for t in outs])
            got = memo.get(key)
            if got is None:
                args = op.args
                if varying:
                    args = set_leaves(
                        args, {p: v for (p, _, _), v in zip(varying, values_here, strict=True)}
                    )
                mem, scratch, dispatches = op_cost(
                    op.primitive,
                    args,
                    [self._layouts[layout[t]] for t in ins],
                    [shapes[t] for t in outs],
                    list(is_state),
                    pos,
                    self._facts,
                    rules,
                )
                decision = (
                    tuple((e.kind, e.source, e.keep_source) for e in mem.effects),
                    scratch > 0,
                    dispatches,
                )
                lids = tuple(self._lid(e.layout) for e in mem.effects)
                donors = mem.effects[0].donors if eligible and mem.effects else ()
                got = memo[key] = (decision, scratch, lids, donors)
            decision, scratch, lids, donors = got
            donor = None
            if donors:
                t = outs[0]
                size = ITEMSIZE[dtype[t]]
                need = prod(shapes[t]) * size + DONATION_SLACK_BYTES  # nbytes
                seg = segment_end[pos]
                for k in donors:
                    x = ins[k]
                    info = donor_info.get(x)
                    if (
                        info is not None
                        and info[0] == seg
                        and ITEMSIZE[dtype[x]] == size
                        and prod(shapes[info[1]]) * ITEMSIZE[dtype[info[1]]] <= need
                    ):
                        donor = k
                        break
            if bound is not None:
                b_decision, b_scratch, b_donor = bound[pos]
                if decision != b_decision or scratch > b_scratch or donor != b_donor:
                    return None
            else:
                out.append((decision, scratch, donor))
                if donor is not None:  # the bound's donated output: an owner from now on
                    name = self._ids[outs[0]]
                    if name in self._facts.donors:
                        root = self._index[self._lives[name].root]
                        self._donor_info[outs[0]] = (self._facts.segment_end[pos], root)
            if donor is not None:
                t = outs[0]
                key = (layout[ins[donor]], shapes[t])
                lid = donated.get(key)
                if lid is None:
                    lid = donated[key] = self._lid(donated_layout(self._layouts[key[0]], key[1]))
                layout[t] = lid
            else:
                for t, lid in zip(outs, lids, strict=True):
                    layout[t] = lid
        return out
