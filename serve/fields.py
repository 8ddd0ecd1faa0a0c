"""Every field an OpenAI completion or chat-completion request may carry, and what this server does
with it: one table, which ``protocol.parse_request`` applies, the tests iterate and the README
renders (``fields_markdown``), beside what mlx_lm.server does with the same field.

A field is honoured; accepted and ignored (it only labels the request for OpenAI's own services and
changes no output); a sampling field (honoured by a plan compiled with ``--sampling``: the app
splits these off for ``serve.sampling_fields``; refused here, under a greedy plan); or
refused (a feature this server does not have). A refused field is still accepted at a value that
asks for nothing (``n`` = 1, ``echo`` = false, ``temperature`` = 0, ...). A field the table does
not know is refused, as OpenAI refuses it (mlx_lm.server ignores it): a misspelt ``max_token``
must not silently generate up to M tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Verdict = Literal["honoured", "ignored", "greedy", "refused"]
Endpoint = Literal["chat", "completions"]

BOTH: tuple[Endpoint, ...] = ("chat", "completions")
CHAT: tuple[Endpoint, ...] = ("chat",)
COMPLETIONS: tuple[Endpoint, ...] = ("completions",)

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

RECOMPILE = "refused under a greedy plan: recompile with --sampling"


@dataclass(frozen=True)
class Field:
    name: str
    endpoints: tuple[Endpoint, ...]
    verdict: Verdict
    why: str  # what the server does, or why it refuses
    mlx_lm: str  # what mlx_lm.server does with the field
    neutral: tuple[Any, ...] = ()  # values that ask for nothing: accepted even when refused

    def asks_nothing(self, value: Any) -> bool:
        """``value`` is absent (null) or one that leaves the output as without the field."""
        return value is None or any(
            value == n and isinstance(value, bool) == isinstance(n, bool) for n in self.neutral
        )


def _greedy(name: str, endpoints: tuple[Endpoint, ...], neutral: tuple, mlx_lm: str) -> Field:
    return Field(name, endpoints, "greedy", RECOMPILE, mlx_lm, neutral)


FIELDS: tuple[Field, ...] = (
    # --- honoured
    Field("model", BOTH, "honoured", "picks the served plan by its name (`GET /v1/models`)",
          "picks the model; loads a model by path or id on request"),
    Field("messages", CHAT, "honoured",
          "rendered with the model folder's chat template; text content parts only",
          "rendered with the chat template (with tools, images)"),
    Field("prompt", COMPLETIONS, "honoured", "one prompt: a string or a list of token ids",
          "a string"),
    Field("max_tokens", BOTH, "honoured", "at most the plan's M (400 above it); default M",
          "honoured; default its --max-tokens"),
    Field("max_completion_tokens", CHAT, "honoured", "as max_tokens (wins when both are given)",
          "as max_tokens (wins when both are given)"),
    Field("stream", BOTH, "honoured", "server-sent events, one chunk per released text piece",
          "server-sent events"),
    Field("stream_options", BOTH, "honoured",
          "`include_usage` adds the usage chunk; `include_obfuscation` is accepted and ignored",
          "`include_usage` honoured"),
    Field("stop", BOTH, "honoured",
          "up to 4 strings, matched on the decoded text (also across tokens and stream chunks); "
          "the text ends before the first one, finish_reason `stop`",
          "each string's own tokenization matched on the token ids"),
    Field("return_token_ids", BOTH, "honoured",
          "this server's extension: each choice also carries the generated token ids",
          "unknown: ignored"),
    # --- accepted and ignored: labels for OpenAI's own services, no effect on the output
    Field("user", BOTH, "ignored", "an end-user label for OpenAI's abuse monitoring", "ignored"),
    Field("safety_identifier", CHAT, "ignored", "an end-user label for OpenAI's abuse monitoring",
          "ignored"),
    Field("metadata", CHAT, "ignored", "tags for OpenAI's stored completions", "ignored"),
    Field("prompt_cache_key", CHAT, "ignored", "a hint for OpenAI's prompt cache", "ignored"),
    Field("prompt_cache_retention", CHAT, "ignored", "a hint for OpenAI's prompt cache", "ignored"),
    Field("prompt_cache_options", CHAT, "ignored", "a hint for OpenAI's prompt cache", "ignored"),
    Field("parallel_tool_calls", CHAT, "ignored", "only has a meaning with `tools` (refused)",
          "ignored"),
    # --- sampling: the plan decodes greedily (honoured by a plan compiled with --sampling)
    _greedy("temperature", BOTH, (0,), "honoured (sampler)"),
    _greedy("top_p", BOTH, (1,), "honoured (sampler)"),
    _greedy("top_k", BOTH, (0,), "honoured (sampler; mlx-lm's extension)"),
    _greedy("min_p", BOTH, (0,), "honoured (sampler; mlx-lm's extension)"),
    _greedy("repetition_penalty", BOTH, (0, 1), "honoured (logits processor; extension)"),
    _greedy("repetition_context_size", BOTH, (), "honoured (extension)"),
    _greedy("logit_bias", BOTH, ({},), "honoured (logits processor)"),
    _greedy("seed", BOTH, (), "honoured (mx.random.seed)"),
    _greedy("logprobs", BOTH, (False,), "honoured"),
    _greedy("top_logprobs", BOTH, (0,), "honoured (at most 11)"),
    # --- refused: features this server does not have
    Field("n", BOTH, "refused", "one choice per request (1 is accepted)", "ignored: one choice",
          (1,)),
    Field("best_of", COMPLETIONS, "refused", "one choice per request (1 is accepted)", "ignored",
          (1,)),
    Field("echo", COMPLETIONS, "refused", "the prompt is not echoed (false is accepted)",
          "ignored", (False,)),
    Field("suffix", COMPLETIONS, "refused", "no insertion after a suffix", "ignored", ("",)),
    Field("presence_penalty", BOTH, "refused", "no presence penalty in the plan (0 is accepted)",
          "honoured (logits processor)", (0,)),
    Field("frequency_penalty", BOTH, "refused", "no frequency penalty in the plan (0 is accepted)",
          "honoured (logits processor)", (0,)),
    Field("tools", CHAT, "refused", "no tool calling", "honoured where the tokenizer parses tools",
          ([],)),
    Field("tool_choice", CHAT, "refused", "no tool calling (`none` is accepted)", "ignored",
          ("none",)),
    Field("functions", CHAT, "refused", "no tool calling (deprecated `tools`)", "ignored", ([],)),
    Field("function_call", CHAT, "refused", "no tool calling (`none` is accepted)", "ignored",
          ("none",)),
    Field("response_format", CHAT, "refused",
          "no constrained output (`{\"type\": \"text\"}` is accepted)", "ignored",
          ({"type": "text"},)),
    Field("audio", CHAT, "refused", "text only", "ignored"),
    Field("modalities", CHAT, "refused", "text only (`[\"text\"]` is accepted)", "ignored",
          (["text"],)),
    Field("prediction", CHAT, "refused", "no predicted outputs", "ignored"),
    Field("reasoning_effort", CHAT, "refused", "no reasoning-effort control", "ignored"),
    Field("verbosity", CHAT, "refused", "no verbosity control", "ignored"),
    Field("web_search_options", CHAT, "refused", "no web search", "ignored"),
    Field("moderation", CHAT, "refused", "no moderation", "ignored"),
    Field("store", CHAT, "refused", "completions are not stored (false is accepted)", "ignored",
          (False,)),
    Field("service_tier", CHAT, "refused", "one tier (`auto` and `default` are accepted)",
          "ignored", ("auto", "default")),
)

BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}


def fields_for(endpoint: Endpoint) -> dict[str, Field]:
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


VERDICT_WORDS = {
    "honoured": "honoured",
    "ignored": "accepted, ignored",
    "greedy": "honoured by a `--sampling` plan (`serve/sampling_fields.py`); a greedy plan refuses "
    "it (400 naming `--sampling`)",
    "refused": "refused (400)",
}


def fields_markdown() -> str:
    """The README's table (README Serving), one row per field, in the table's order."""
    rows = [
        "| field | endpoints | dctms serve | mlx_lm.server |",
        "|---|---|---|---|",
    ]
    for f in FIELDS:
        where = "both" if f.endpoints == BOTH else f.endpoints[0]
        verdict = VERDICT_WORDS[f.verdict]
        said = verdict if f.verdict == "greedy" else f"{verdict}: {f.why}"
        rows.append(f"| `{f.name}` | {where} | {said} | {f.mlx_lm} |")
    rows.append(
        "| any other field | both | refused (400), as OpenAI refuses it | ignored |"
    )
    return "\n".join(rows) + "\n"
