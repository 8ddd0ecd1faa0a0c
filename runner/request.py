"""A generation request checked against a plan's bounds, once, before anything is loaded.

``validate_request`` is pure (no MLX call, no global state) and is the only place the runner checks
a prompt, a token count and token ids; ``Session.generate`` takes its result and checks nothing
again. The Session, when it opens, checks the arrays it allocated against the same bounds
(``session.check_allocation``), so a request valid for the plan is valid for its arrays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dctms.runner.sampling import SamplingParams, check_params
from dctms.schema.errors import DctmsError
from dctms.schema.types import Plan

GREEDY = SamplingParams()


@dataclass(frozen=True)
class Request:
    """A prompt, how many tokens to generate and where to stop, valid for ``plan``."""

    plan: Plan
    prompt: tuple[int, ...]
    max_tokens: int
    stop: frozenset[int]
    sampling: SamplingParams = GREEDY  # checked against the plan (runner.sampling)


class RequestRefused(DctmsError):
    """A request the plan cannot serve; ``value`` and ``bound`` are the figures that clash, so a
    front end (the CLI, the HTTP server) can word the refusal its own way."""

    def __init__(self, message: str, value: int = 0, bound: int = 0):
        super().__init__(message)
        self.value, self.bound = value, bound


class PromptTooLong(RequestRefused):
    """A prompt longer than the plan's N."""


class EmptyPrompt(RequestRefused):
    """A prompt of no tokens."""


class TooManyTokens(RequestRefused):
    """More tokens asked for than the plan's M (or fewer than 1)."""


class TokenOutsideVocabulary(RequestRefused):
    """A prompt id the embedding has no row for; ``value`` is the id, ``index`` its position."""

    def __init__(self, message: str, value: int, bound: int, index: int):
        super().__init__(message, value, bound)
        self.index = index


def validate_request(
    plan: Plan,
    prompt: Iterable[int],
    max_tokens: int,
    stop: Iterable[int] = (),
    sampling: SamplingParams = GREEDY,
) -> Request:
    """Refuse, with one line naming the problem, a request the plan cannot serve: a
    token count outside 1..M, an empty prompt or one longer than N, an id outside the vocabulary,
    sampling settings the plan or mlx-lm does not take."""
    return validate_requests(plan, [prompt], max_tokens, stop, sampling)[0]


def validate_requests(
    plan: Plan,
    prompts: Iterable[Iterable[int]],
    max_tokens: int,
    stop: Iterable[int] = (),
    sampling: SamplingParams = GREEDY,
) -> list[Request]:
    """``validate_request`` for several prompts generating the same number of tokens."""
    check_params(plan, sampling)
    b = plan.bounds
    if max_tokens < 1:
        raise TooManyTokens(f"--max-tokens must be at least 1, got {max_tokens}", max_tokens, 1)
    if max_tokens > b.output_tokens:
        raise TooManyTokens(
            f"--max-tokens {max_tokens} exceeds the plan's M = {b.output_tokens}; "
            "recompile with a larger -M",
            max_tokens,
            b.output_tokens,
        )
    stop = frozenset(stop)
    requests = []
    for prompt in prompts:
        ids = tuple(prompt)
        if not ids:
            raise EmptyPrompt("empty prompt: at least one token is needed", 0, 1)
        if len(ids) > b.input_tokens:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens, the plan allows N = {b.input_tokens}; "
                "recompile with a larger -N",
                len(ids),
                b.input_tokens,
            )
        _check_ids(plan, ids)
        requests.append(Request(plan, ids, max_tokens, stop, sampling))
    return requests


def _check_ids(plan: Plan, ids: tuple[int, ...]) -> None:
    # Every id indexes the embedding: MLX's gather does not bounds-check (out of range is a
    # segmentation fault or garbage, not an error).
    vocab = plan.model.vocab_size
    for i, t in enumerate(ids):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise TokenOutsideVocabulary(
                f"prompt token {i} is {t}, outside the model's vocabulary [0, {vocab}) "
                "(wrong tokenizer or token ids?)",
                t,
                vocab,
                i,
            )
