"""The sampling fields of an OpenAI request (and mlx_lm.server's extensions), for a plan compiled
with ``--sampling``; and the ``logprobs`` a response carries.

Kept apart from ``serve.protocol``: ``split_sampling`` takes these fields out of the body before
the protocol's own checks see it, and ``sampling_params`` turns them into the runner's
``SamplingParams`` for one plan, refusing (HTTP 400, naming the field) what the plan or mlx-lm does
not take; a greedy-only plan names the recompile flag. Field names and defaults are mlx_lm.server's.
"""

from __future__ import annotations

import math
from typing import Any

from dctms.runner.sampling import SamplingParams, check_params
from dctms.schema.errors import DctmsError
from dctms.schema.sampling import RECOMPILE, samples
from dctms.schema.slotted import slotted
from dctms.schema.types import Plan
from dctms.serve.protocol import ApiError

FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "logit_bias",
    "seed",
    "logprobs",
    "top_logprobs",
)


def split_sampling(body: Any) -> tuple[Any, dict[str, Any]]:
    """(the body without the sampling fields, those fields as given); a non-object body is left
    for the protocol to refuse."""
    if not isinstance(body, dict):
        return body, {}
    rest = {k: v for k, v in body.items() if k not in FIELDS}
    return rest, {k: body[k] for k in FIELDS if body.get(k) is not None}


def _number(fields: dict, name: str, default: float) -> float:
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a finite number, got {value!r}", name)
    return float(value)


def _integer(fields: dict, name: str, default: int) -> int:
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", name)
    return value


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias", "logit_bias")
    bias = {}
    for key, v in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(400, f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
        bias[token] = _number({"logit_bias": v}, "logit_bias", 0.0)
    return bias


def _logprobs(fields: dict, chat: bool) -> tuple[bool, int]:
    """(report the chosen token's log-probability, how many of the largest): chat takes
    ``logprobs: true`` and ``top_logprobs: k``; completions ``logprobs: k``."""
    if chat:
        wanted = fields.get("logprobs", False)
        if not isinstance(wanted, bool):
            raise ApiError(400, f"'logprobs' must be true or false, got {wanted!r}", "logprobs")
        top = _integer(fields, "top_logprobs", 0)
        if top and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return wanted, top
    if "top_logprobs" in fields:
        raise ApiError(400, "'top_logprobs' is a chat field; completions take 'logprobs': k",
                       "top_logprobs")
    top = _integer(fields, "logprobs", 0) if "logprobs" in fields else None
    return top is not None, top or 0


def sampling_params(fields: dict[str, Any], plan: Plan, chat: bool) -> SamplingParams:
    """The runner's settings for ``fields`` on ``plan``, checked (HTTP 400 naming the field)."""
    wanted, top = _logprobs(fields, chat)
    penalty = fields.get("repetition_penalty")
    params = SamplingParams(
        temp=_number(fields, "temperature", 0.0),
        top_p=_number(fields, "top_p", 0.0),
        top_k=_integer(fields, "top_k", 0),
        min_p=_number(fields, "min_p", 0.0),
        repetition_penalty=None if penalty is None else _number(fields, "repetition_penalty", 0),
        repetition_context_size=_integer(fields, "repetition_context_size", 20),
        logit_bias=_logit_bias(fields["logit_bias"]) if "logit_bias" in fields else {},
        seed=_integer(fields, "seed", 0) if "seed" in fields else None,
        top_logprobs=top,
        logprobs=wanted,
    )
    if not samples(plan) and params.asks_for_plan():
        asked = [k for k in FIELDS if k in fields and k not in ("top_p", "top_k", "min_p", "seed")]
        if slotted(plan.bounds):  # --sampling does not combine with slots (yet)
            raise ApiError(
                400,
                f"{', '.join(repr(k) for k in asked)} need(s) a batch-1 plan compiled with "
                f"`dctms compile ... {RECOMPILE}`: this model's plan "
                + (f"is batched ({plan.bounds.batch} slots)" if plan.bounds.batch > 1
                   else "runs in a slot (its prompt-prefix pool)")
                + " and decodes greedily only",
                asked[0] if asked else None,
            )
        raise ApiError(
            400,
            f"{', '.join(repr(k) for k in asked)} need(s) a plan compiled with `dctms compile "
            f"... {RECOMPILE}`: this model's plan decodes greedily only",
            asked[0] if asked else None,
        )
    try:
        check_params(plan, params)
    except DctmsError as err:
        raise ApiError(400, str(err), _field_named(str(err))) from None
    return params


def _field_named(message: str) -> str | None:
    names = {"temperature": "temperature", "context_size": "repetition_context_size"}
    for word, field in names.items():
        if word in message:
            return field
    return next((f for f in FIELDS if message.startswith(f)), None)


def logprobs_body(gen, hidden: frozenset[int], decode, chat: bool) -> dict | None:
    """A choice's ``logprobs`` in OpenAI's format for the tokens in the text (not ``hidden``):
    chat ``{content: [{token, logprob, bytes, top_logprobs}]}``; completions ``{tokens,
    token_logprobs, top_logprobs, text_offset}``. None when the request asked for none."""
    if not gen.logprobs:
        return None
    rows = list(zip(gen.tokens, gen.logprobs, strict=False))
    return logprobs_rows(rows, hidden, decode, chat)


def logprobs_rows(rows: list, hidden: frozenset[int], decode, chat: bool,
                  offset: int = 0) -> dict:
    """``logprobs_body`` for some of a generation's (token, TokenLogprobs): a streamed chunk's;
    ``offset``: the text already sent before them (completions' ``text_offset``)."""
    rows = [(t, lp) for t, lp in rows if t not in hidden]
    if chat:
        return {
            "content": [
                {
                    **_token(decode, t, lp.logprob),
                    "top_logprobs": [_token(decode, i, v) for i, v in lp.top],
                }
                for t, lp in rows
            ]
        }
    texts = [decode([t]) for t, _ in rows]
    offsets = [offset + sum(len(x) for x in texts[:k]) for k in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [lp.logprob for _, lp in rows],
        "top_logprobs": [{decode([i]): v for i, v in lp.top} for _, lp in rows],
        "text_offset": offsets,
    }


def _token(decode, token: int, logprob: float) -> dict:
    text = decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
