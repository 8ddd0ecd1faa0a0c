"""What the runner feeds a sampling plan (``compile --sampling``) and how it reads its results.

``SamplingParams`` are mlx-lm's ``make_sampler`` / ``make_logits_processors`` arguments and a seed;
``sampling_feeds`` checks them against the plan (one line naming the problem: a greedy plan names
the recompile flag) and turns them into the phase inputs ``schema.sampling`` names. The runner
then threads the key and the repetition window from call to call as the plan returns them, so
the draws follow MLX's global key sequence after ``mx.random.seed(seed)``: ``key(seed)``, split
once per sampled token.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import mlx.core as mx

from dctms.schema.errors import DctmsError
from dctms.schema.sampling import INPUTS, RECOMPILE, samples
from dctms.schema.types import Plan

SEED_BOUND = 2**64  # mx.random.seed takes an unsigned 64-bit seed


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's sampler and logits-processor settings; the defaults are greedy, no processor."""

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    top_logprobs: int = 0  # how many of the largest log-probabilities each token reports
    logprobs: bool = False  # report the chosen token's log-probability

    def asks_for_plan(self) -> bool:
        """Whether these settings need a sampling plan: a temperature, a logits processor or
        log-probabilities (at temperature 0 mlx-lm's sampler is argmax whatever top_p, top_k or
        min_p say, and a seed draws nothing)."""
        return (
            self.temp != 0
            or self.repetition_penalty not in (None, 0)
            or bool(self.logit_bias)
            or self.logprobs
            or self.top_logprobs > 0
        )


@dataclass(frozen=True)
class Sampling:
    """The checked settings of one generation: its constant feeds and its first key."""

    params: SamplingParams
    seed: int
    feeds: dict[str, mx.array]  # every sampling input but key and recent
    key: mx.array
    window: int  # the plan's repetition window R

    def recent(self, prompt: list[int]) -> mx.array:
        """The prompt's last R ids, oldest first; missing slots repeat the last id (already in
        the window, so penalising it again changes nothing)."""
        tail = prompt[-self.window :]
        padded = [tail[-1]] * (self.window - len(tail)) + tail
        return mx.array(padded, dtype=mx.uint32)


def binding_sizes(plan: Plan) -> dict[str, int]:
    """R (repetition window), B (logit-bias slots) and K (top log-probabilities) of a sampling
    plan, from its decode phase's bindings (the verifier checked every phase agrees)."""
    decode = next(p for p in plan.phases if p.name == "decode")
    given = {b.name: b for b in [*decode.inputs, *decode.outputs]}
    return {
        "R": given["recent"].shape[0],
        "B": given["bias_ids"].shape[0],
        "K": given["top_ids"].shape[-1],
    }


def refuse_greedy(params: SamplingParams, plan: Plan) -> None:
    """A greedy-only plan given settings it cannot honour: one line naming the recompile flag."""
    if not samples(plan) and params.asks_for_plan():
        raise DctmsError(
            f"this plan decodes greedily only: {describe(params)} needs a plan compiled with "
            f"`dctms compile ... {RECOMPILE}`"
        )


def describe(params: SamplingParams) -> str:
    """The non-default settings, named as `dctms run` spells them."""
    default = SamplingParams()
    names = {
        "temp": "--temp",
        "top_p": "--top-p",
        "top_k": "--top-k",
        "min_p": "--min-p",
        "repetition_penalty": "--repetition-penalty",
        "repetition_context_size": "--repetition-context-size",
        "logit_bias": "--logit-bias",
        "top_logprobs": "--logprobs",
        "logprobs": "--logprobs",
    }
    given = [flag for k, flag in names.items() if getattr(params, k) != getattr(default, k)]
    return ", ".join(dict.fromkeys(given)) or "sampling"


def check_params(plan: Plan, params: SamplingParams) -> None:
    """Refuse, in one line, a setting outside what mlx-lm or the plan accepts (pure)."""
    refuse_greedy(params, plan)
    if samples(plan):
        _check(params, binding_sizes(plan), plan.model.vocab_size)


def prepare(plan: Plan, params: SamplingParams) -> Sampling | None:
    """The feeds of one generation with ``params`` as ``check_params`` accepted them (None for a
    greedy plan, which takes none)."""
    if not samples(plan):
        return None
    sizes = binding_sizes(plan)
    seed = params.seed if params.seed is not None else secrets.randbelow(SEED_BOUND)
    dtype = {name: want[1] for name, want in INPUTS.items()}
    values = {
        "inv_temperature": 0.0 if params.temp == 0 else 1.0 / params.temp,
        "top_p": params.top_p,
        "log_min_p": -math.inf if params.min_p == 0 else math.log(params.min_p),
        "top_k": params.top_k,
        "penalty": params.repetition_penalty or 1.0,  # mlx-lm: None or 0 adds no processor
        "context": params.repetition_context_size,
    }
    feeds = {k: mx.array(v, dtype=getattr(mx, dtype[k])) for k, v in values.items()}
    ids, biases = _bias_slots(params.logit_bias, sizes["B"])
    feeds["bias_ids"] = mx.array(ids, dtype=mx.uint32)
    feeds["bias_values"] = mx.array(biases, dtype=mx.float32)
    return Sampling(params, seed, feeds, _key(seed), sizes["R"])


def _key(seed: int) -> mx.array:
    # mx.random.key(seed): the two 32-bit halves of the seed, high first
    return mx.array([seed >> 32, seed & 0xFFFFFFFF], dtype=mx.uint32)


def _bias_slots(bias: dict[int, float], slots: int) -> tuple[list[int], list[float]]:
    """The pairs, then the first pair again in every unused slot (writing the same sum twice);
    no pairs: id 0 plus 0."""
    pairs = list(bias.items()) or [(0, 0.0)]
    pairs += [pairs[0]] * (slots - len(pairs))
    return [i for i, _ in pairs], [v for _, v in pairs]


def _check(p: SamplingParams, sizes: dict[str, int], vocab: int) -> None:
    def finite(name: str, value: float) -> None:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DctmsError(f"{name} must be a finite number, got {value!r}")

    finite("temperature", p.temp)
    if p.temp < 0:
        raise DctmsError(f"temperature must be 0 (greedy) or more, got {p.temp}")
    finite("top_p", p.top_p)
    if not 0 <= p.top_p <= 1:
        raise DctmsError(f"top_p must be in [0, 1], got {p.top_p}")
    finite("min_p", p.min_p)
    if not 0 <= p.min_p <= 1:
        raise DctmsError(f"min_p must be in [0, 1] (as mlx-lm), got {p.min_p}")
    if not 0 <= p.top_k < vocab:
        raise DctmsError(f"top_k must be 0 (off) or below the vocabulary size {vocab}, got {p.top_k}")
    if p.repetition_penalty is not None:
        finite("repetition_penalty", p.repetition_penalty)
        if p.repetition_penalty < 0:
            raise DctmsError(
                f"repetition_penalty must be non-negative (as mlx-lm), got {p.repetition_penalty}"
            )
    if not 1 <= p.repetition_context_size <= sizes["R"]:
        raise DctmsError(
            f"repetition_context_size must be 1..{sizes['R']} (this plan's window), got "
            f"{p.repetition_context_size}"
        )
    if len(p.logit_bias) > sizes["B"]:
        raise DctmsError(
            f"logit_bias has {len(p.logit_bias)} entries; this plan takes at most {sizes['B']}"
        )
    for token, value in p.logit_bias.items():
        if not isinstance(token, int) or not 0 <= token < vocab:
            raise DctmsError(f"logit_bias token {token!r} is outside the vocabulary [0, {vocab})")
        finite(f"logit_bias[{token}]", value)
    if not 0 <= p.top_logprobs <= sizes["K"]:
        raise DctmsError(f"top_logprobs must be 0..{sizes['K']} for this plan, got {p.top_logprobs}")
    if p.seed is not None and not 0 <= p.seed < SEED_BOUND:
        raise DctmsError(f"seed must be in [0, 2^64), got {p.seed}")


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the largest ones, highest first."""

    logprob: float
    top: list[tuple[int, float]]


def read_logprobs(out: dict[str, mx.array], top: int) -> TokenLogprobs:
    """The chosen token's log-probability and the ``top`` largest from a call's outputs."""
    logprob = float(out["logprob"].item())
    if top == 0:
        return TokenLogprobs(logprob, [])
    ids = out["top_ids"].reshape(-1).tolist()[::-1][:top]
    values = out["top_logprobs"].reshape(-1).tolist()[::-1][:top]
    return TokenLogprobs(logprob, list(zip(ids, values, strict=True)))
