"""Verifier rule for speculative plans: the draft and the target's verify phase fit together.

The draft's own phases, state, fingerprint and envelope part are checked by every other rule, run
on ``draft.draft_view`` (see ``verify.verify_plan``); this rule checks what ties the two models:

- a plan has a draft exactly when its envelope has parts, and then exactly one "target" and one
  "draft" part;
- the target has a "verify" phase of ``num_draft + 1`` tokens fed ``tokens`` and ``position``,
  returning ``next_token`` of one greedy id per token; only a plan with a draft has one;
- both models share one vocabulary (the draft's ids are fed to the target);
- the cache holds the verify call's writes: the last call starts at N + M - 2 and writes
  ``num_draft + 1`` positions, so ``kv_capacity`` >= N + M + num_draft - 1.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.draft import DRAFT, TARGET, VERIFY
from dctms.schema.phase_index import PlanIndex

Finding = tuple[str, str]

VERIFY_INPUTS = ("tokens", "position")


def speculative(ix: PlanIndex) -> Iterator[Finding]:
    plan = ix.plan
    draft, parts = plan.draft, plan.envelope.parts
    verify = [(k, p) for k, p in enumerate(plan.phases) if p.name == VERIFY]
    if draft is None:
        if parts:
            yield "$.envelope.parts", "envelope parts are given, but the plan has no draft"
        for k, _ in verify:
            yield f"$.phases[{k}].name", "a verify phase needs a draft model (plan.draft)"
        return
    if sorted(p.model for p in parts) != sorted([TARGET, DRAFT]):
        yield "$.envelope.parts", "a plan with a draft needs one target part and one draft part"
    if draft.model.vocab_size != plan.model.vocab_size:
        yield (
            "$.draft.model.vocab_size",
            f"{draft.model.vocab_size}, but the target's vocab_size is {plan.model.vocab_size}",
        )
    if not verify:
        yield "$.phases", "a plan with a draft needs the target's verify phase"
        return
    k, phase = verify[0]
    where = f"$.phases[{k}]"
    want = draft.num_draft + 1
    if phase.tokens != want:
        yield f"{where}.tokens", f"{phase.tokens}, but verify processes num_draft + 1 = {want}"
    fed = [b.name for b in phase.inputs if b.kind == "input"]
    if sorted(fed) != sorted(VERIFY_INPUTS):
        yield f"{where}.inputs", f"verify takes {', '.join(VERIFY_INPUTS)}; got {', '.join(fed)}"
    result = [b for b in phase.outputs if b.kind == "output" and b.name == "next_token"]
    if not result:
        yield f"{where}.outputs", "no output binding named 'next_token'"
    elif result[0].shape != [plan.bounds.batch, want]:
        yield (
            f"{where}.outputs",
            f"next_token is {result[0].shape}, verify returns [{plan.bounds.batch}, {want}]",
        )
    b = plan.bounds
    need = b.input_tokens + b.output_tokens + draft.num_draft - 1
    if b.kv_capacity < need:
        yield (
            "$.bounds.kv_capacity",
            f"{b.kv_capacity} positions cannot hold the last verify call's writes "
            f"(N + M + num_draft - 1 = {need})",
        )
