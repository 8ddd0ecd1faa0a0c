"""Verifier rule for a rank's plan (``Plan.distributed``): the rank, its layers, its collectives and
its weight shards agree with each other and with the model.

- only a rank's plan has collective ops (``AllReduce``, ``AllGather``, ``Send``, ``Recv``), and a
  Send or Recv names another rank of the group;
- ``rank`` < ``ranks``; a tensor-parallel rank runs every layer; a pipeline rank runs the layers its
  ``split`` gives it (one positive count per rank, summing to the model's layers; rank ranks-1 runs
  the first ones, as mlx-lm splits);
- a sharded weight is part ``index`` < ``parts`` = ``ranks`` of its stored tensor, whose shape differs
  from the weight's only along ``axis``, by the factor ``parts``; only tensor-parallel ranks shard;
- the weights a pipeline rank skips are not weights of the plan;
- the compile request (when recorded) asked for this rank of this split.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.phase_index import PlanIndex

Finding = tuple[str, str]

COLLECTIVE_PRIMITIVES = frozenset({"AllReduce", "AllGather", "Send", "Recv"})
PEERED = frozenset({"Send", "Recv"})


def distributed(ix: PlanIndex) -> Iterator[Finding]:
    plan = ix.plan
    d = plan.distributed
    for k, phase in enumerate(plan.phases):
        for i, op in enumerate(phase.ops):
            if op.primitive not in COLLECTIVE_PRIMITIVES:
                continue
            where = f"$.phases[{k}].ops[{i}]"
            if d is None:
                yield (
                    where,
                    f"{op.primitive} in a plan that is not a rank's (no distributed section)",
                )
            elif op.primitive in PEERED:
                peer = op.args[0] if op.args and isinstance(op.args[0], int) else None
                if peer is None or not 0 <= peer < d.ranks or peer == d.rank:
                    yield (
                        f"{where}.args",
                        (
                            f"{op.primitive} peer {op.args[:1]} is not another of the {d.ranks} ranks"
                        ),
                    )
    if d is None:
        if any(w.shard is not None for w in plan.model.weights.tensors):
            yield "$.model.weights", "weight shards in a plan that is not a rank's"
        return
    yield from _rank(ix)
    yield from _shards(ix)


def _rank(ix: PlanIndex) -> Iterator[Finding]:
    plan = ix.plan
    d, total = plan.distributed, plan.model.num_layers
    if d.rank >= d.ranks:
        yield "$.distributed.rank", f"rank {d.rank} is not one of the {d.ranks} ranks"
    if len(d.layers) != 2 or not 0 <= d.layers[0] < d.layers[1] <= total:
        yield "$.distributed.layers", f"layers {d.layers} are not a range of the {total} layers"
        return
    if d.mode == "tensor":
        if d.layers != [0, total] or d.split or d.skipped_weights:
            yield "$.distributed", "a tensor-parallel rank runs every layer and skips no weight"
    else:
        if len(d.split) != d.ranks or sum(d.split) != total:
            yield (
                "$.distributed.split",
                (f"split {d.split} is not {d.ranks} layer counts summing to {total}"),
            )
        elif d.rank < d.ranks:
            start = sum(d.split[d.rank + 1 :])
            if d.layers != [start, start + d.split[d.rank]]:
                yield (
                    "$.distributed.layers",
                    (
                        f"rank {d.rank} of split {d.split} runs layers "
                        f"[{start}, {start + d.split[d.rank]}), not {d.layers}"
                    ),
                )
        held = {w.name for w in plan.model.weights.tensors}
        both = sorted(held & set(d.skipped_weights))
        if both:
            yield "$.distributed.skipped_weights", f"{both[0]} is skipped and a weight of the plan"
    req = plan.compile
    if req is not None and (req.ranks, req.rank, req.parallel) != (d.ranks, d.rank, d.mode):
        yield (
            "$.compile",
            (
                f"the request asked for rank {req.rank} of {req.ranks} ({req.parallel}), the plan is "
                f"rank {d.rank} of {d.ranks} ({d.mode})"
            ),
        )


def _shards(ix: PlanIndex) -> Iterator[Finding]:
    plan = ix.plan
    d = plan.distributed
    for k, w in enumerate(plan.model.weights.tensors):
        s = w.shard
        if s is None:
            continue
        where = f"$.model.weights.tensors[{k}].shard"
        if d.mode != "tensor":
            yield where, "only a tensor-parallel rank holds weight shards"
            continue
        if s.parts != d.ranks or s.index >= s.parts:
            yield where, f"part {s.index} of {s.parts} is not this group's ({d.ranks} ranks)"
        if s.axis >= len(w.shape) or len(s.stored_shape) != len(w.shape):
            yield where, f"axis {s.axis} of a {len(w.shape)}-d weight stored as {s.stored_shape}"
            continue
        want = list(w.shape)
        want[s.axis] *= s.parts
        if want != s.stored_shape or s.stored_shape[s.axis] % (s.parts * s.segments):
            yield (
                where,
                (f"{w.name} {w.shape} is not 1/{s.parts} of {s.stored_shape} along axis {s.axis}"),
            )
