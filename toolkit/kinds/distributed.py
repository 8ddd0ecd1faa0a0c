"""A distributed plan: every rank's plan, compiled one after another, and the pipeline split that
minimises the largest per-rank M_max.

One rank's model and its tracing (mlx-lm's own split, collectives as ops) are ``kinds.rank``'s,
which the compiler imports; this module compiles ranks through the compiler, so the compiler never
imports it (one direction: ``kinds.distributed`` -> ``compiler`` -> ``kinds.rank``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import replace as dc_replace

from dctms.schema.types import Plan
from dctms.toolkit.compiler import compile_plan
from dctms.toolkit.kinds.rank import LAYER


def compile_ranks(source, opts, progress=None, *, probe: bool = False) -> list[Plan]:
    """Every rank's plan (``opts.rank`` is ignored), in rank order."""
    say = progress or (lambda _msg: None)
    plans = []
    for r in range(opts.ranks):
        say(f"compiling rank {r} of {opts.ranks}")
        plans.append(compile_plan(source, _with(opts, rank=r), progress, probe=probe))
    return plans


def widest_rank(source, opts, *, probe: bool = False) -> Plan:
    """The rank plan with the largest M_max (what a per-rank budget must hold)."""
    return max(compile_ranks(source, opts, probe=probe), key=lambda p: (p.envelope.total, -p.distributed.rank))


def _with(opts, **changes):
    return dc_replace(opts, **changes)


@dataclass(frozen=True)
class SplitChoice:
    """The pipeline split that minimises the largest per-rank M_max, and how it was found."""

    count: tuple[int, ...]  # the split by layer count (mlx-lm's default)
    memory: tuple[int, ...]  # the memory-balanced split
    predicted: tuple[int, ...]  # per-rank M_max the cost model predicts for ``memory``
    layer_bytes: tuple[int, ...]  # weights + KV of each decoder layer, from the plans
    fixed_bytes: tuple[int, ...]  # per rank: M_max minus its layers' bytes


def layer_costs(plans: list[Plan]) -> tuple[list[int], list[int]]:
    """From the plans of one split: each layer's bytes (its weights and its KV cache) and each
    rank's fixed bytes (the rest of its M_max: replicated weights, arena, runtime, ...)."""
    total = plans[0].model.num_layers
    per_layer = [0] * total
    fixed = []
    for plan in plans:
        start, end = plan.distributed.layers
        mine = 0
        for w in plan.model.weights.tensors:
            m = LAYER.search(w.name)
            if m is not None:
                per_layer[int(m.group(1))] += w.bytes
                mine += w.bytes
        for s in plan.state:
            m = re.match(r"kv\.(\d+)\.", s.name)
            if s.kind == "kv" and m is not None:
                per_layer[start + int(m.group(1))] += s.bytes
                mine += s.bytes
        fixed.append(plan.envelope.total - mine)
    return per_layer, fixed


def balanced_split(per_layer: list[int], fixed: list[int]) -> tuple[tuple[int, ...], int]:
    """The split (layers per rank, rank order) minimising max_r fixed[r] + bytes of its layers.
    Rank R-1 runs the first layers (mlx-lm splits in reverse). Ties: the earliest in
    lexicographic order of the split, so the answer is deterministic."""
    ranks, total = len(fixed), len(per_layer)
    prefix = [0]
    for b in per_layer:
        prefix.append(prefix[-1] + b)
    # best[r][k]: (worst, split of ranks r..R-1) when ranks r..R-1 hold the first k layers.
    memo: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}

    def best(r: int, k: int) -> tuple[int, tuple[int, ...]]:
        # rank r holds layers [k - n, k) for some n; ranks r+1.. hold the first k - n.
        if (r, k) in memo:
            return memo[r, k]
        if r == ranks - 1:
            found = (fixed[r] + prefix[k], (k,))
        else:
            options = []
            for n in range(1, k - (ranks - 1 - r) + 1):
                worst, rest = best(r + 1, k - n)
                options.append((max(worst, fixed[r] + prefix[k] - prefix[k - n]), (n, *rest)))
            found = min(options)
        memo[r, k] = found
        return found

    worst, split = best(0, total)
    return split, worst


def choose_split(source, opts, progress=None) -> tuple[SplitChoice, list[Plan]]:
    """Compile the count split, derive the layer and rank costs from its plans, pick the split
    that minimises the largest per-rank M_max, and compile that one too (its plans are returned:
    their M_max is measured, not predicted)."""
    count_plans = compile_ranks(source, _with(opts, split=None), progress)
    per_layer, fixed = layer_costs(count_plans)
    split, worst = balanced_split(per_layer, fixed)
    count = tuple(count_plans[0].distributed.split)
    if max(predict(count, per_layer, fixed)) <= worst:
        split = count  # a tie keeps mlx-lm's default
    predicted = predict(split, per_layer, fixed)
    choice = SplitChoice(count, split, predicted, tuple(per_layer), tuple(fixed))
    if split == count:
        return choice, count_plans
    return choice, compile_ranks(source, _with(opts, split=split), progress)


def predict(split, per_layer: list[int], fixed: list[int]) -> tuple[int, ...]:
    """Per-rank M_max the cost model gives a split (rank R-1 holds the first layers)."""
    out, start = [], sum(split)
    for r, n in enumerate(split):
        start -= n
        out.append(fixed[r] + sum(per_layer[start : start + n]))
    return tuple(out)
