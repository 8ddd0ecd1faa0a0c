"""Verifier rule for a sampling plan: its prefill and decode phases take exactly the inputs the
runner feeds (``schema.sampling``) and return the outputs it reads, in the shapes it builds them.

The runner bounds every id it feeds (recent tokens, logit-bias ids) by ``model.vocab_size``, so
the sizes that matter are read from the bindings here: one repetition window ``R`` shared by the
input and the decode output, one slot count ``B`` for bias ids and values, one ``K`` for the top
log-probabilities, at most the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.phase_index import PlanIndex
from dctms.schema.sampling import INPUTS, SAMPLED_PHASES, outputs_for, samples

Finding = tuple[str, str]


def sampling(ix: PlanIndex) -> Iterator[Finding]:
    """A --sampling plan's prefill and decode have every sampling input and output, in the shapes
    and dtypes the runner feeds and reads; no other phase takes one."""
    plan = ix.plan
    sizes: dict[str, int] = {}  # R, B, K: the same in every phase
    for px in ix.phases:
        if px.phase.name not in SAMPLED_PHASES:
            if samples(plan) and any(b.name in INPUTS for b in px.phase.inputs):
                yield f"{px.path}.inputs", f"{px.phase.name} takes sampling inputs the runner never feeds"
            continue
        if not samples(plan):
            continue
        given = {b.name: b for b in px.phase.inputs if b.kind == "input"}
        for name, want in INPUTS.items():
            yield from _binding(f"{px.path}.inputs", name, given.get(name), want, sizes)
        results = {b.name: b for b in px.phase.outputs if b.kind == "output"}
        for name, want in outputs_for(px.phase.name).items():
            yield from _binding(f"{px.path}.outputs", name, results.get(name), want, sizes)
        for letter, size in sizes.items():
            if size < 1:
                yield px.path, f"sampling size {letter} is {size}, must be at least 1"
        if sizes.get("K", 0) > plan.model.vocab_size:
            yield px.path, f"{sizes['K']} top log-probabilities, more than the vocabulary"


def _binding(where: str, name: str, b, want: tuple, sizes: dict[str, int]) -> Iterator[Finding]:
    shape, dtype = want
    if b is None:
        yield where, f"no binding named {name!r} (a --sampling plan's phases have it)"
        return
    if len(b.shape) != len(shape):
        yield where, f"{name!r} has shape {list(b.shape)}, expected {len(shape)} axes"
        return
    for got, expected in zip(b.shape, shape, strict=True):
        if isinstance(expected, str):
            if sizes.setdefault(expected, got) != got:
                yield where, f"{name!r} has {got} along {expected}, elsewhere {sizes[expected]}"
        elif got != expected:
            yield where, f"{name!r} has shape {list(b.shape)}, expected {list(shape)}"
    if dtype is not None and b.dtype != dtype:
        yield where, f"{name!r} is {b.dtype}, expected {dtype}"
