"""The draft model of a speculative plan seen as a plan of its own.

A plan with ``draft`` holds two models. The draft's phases, state and fingerprint are checked by the
same verifier rules as any plan's, and loaded by the same runner code, through ``draft_view``: the
plan with the draft's model, state, phases and stats in place of the target's, and as envelope the
draft's ``EnvelopePart`` (plus the plan's runtime allowance, which the process holds once).
"""

from __future__ import annotations

import msgspec

from dctms.schema.types import Envelope, EnvelopePart, Plan

TARGET, DRAFT = "target", "draft"
VERIFY = "verify"  # the target's phase that scores the draft's tokens
DEFAULT_NUM_DRAFT = 3  # draft tokens per verify call unless asked (mlx_lm.generate --num-draft-tokens)


def part(plan: Plan, model: str) -> EnvelopePart | None:
    """The envelope part of ``model`` ("target" or "draft"), when the plan has parts."""
    return next((p for p in plan.envelope.parts if p.model == model), None)


def draft_view(plan: Plan) -> Plan:
    """The draft as a plan: its model, state, phases, stats and envelope part; bounds and target
    are the plan's. Raises ValueError for a plan without a draft."""
    draft = plan.draft
    if draft is None:
        raise ValueError("the plan has no draft model")
    share = part(plan, DRAFT)
    env = plan.envelope
    if share is None:
        share = EnvelopePart(DRAFT, 0, 0, 0, 0)
    total = share.weights + share.kv + share.persistent + share.intermediate + env.runtime
    device = plan.target.device_memory
    envelope = Envelope(
        weights=share.weights,
        kv=share.kv,
        persistent=share.persistent,
        intermediate=share.intermediate,
        runtime=env.runtime,
        total=total,
        runtime_source=env.runtime_source,
        device=device,
        free=None if device is None else device - total,
    )
    return msgspec.structs.replace(
        plan,
        model=draft.model,
        state=draft.state,
        phases=draft.phases,
        stats=draft.stats,
        envelope=envelope,
        compile=None,
        draft=None,
        modules=draft.modules,  # the draft's own tree (Draft.modules)
        digest="",
    )
