"""OpenAI's completion and chat-completion requests, checked against a plan's bounds; responses.

Pure functions over plain data: a request body in, a ``CompletionRequest`` or an ``ApiError`` (HTTP
status + OpenAI-style error body) out. Every field is honoured or refused by the table in
``serve.fields``: decoding is greedy, so a request asking for sampling is refused rather than
silently answered greedily, and a field this server does not know is refused rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dctms.runner.request import (
    EmptyPrompt,
    PromptTooLong,
    RequestRefused,
    TokenOutsideVocabulary,
    TooManyTokens,
)
from dctms.serve.fields import BY_NAME, PATHS, RECOMPILE, Endpoint, fields_for


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or {400: "invalid_request", 404: "model_not_found"}.get(status, "error")

    def body(self) -> dict:
        kind = {
            400: "invalid_request_error",
            404: "invalid_request_error",
            503: "server_busy",
        }.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | list[int] | None  # /v1/completions: text or token ids
    messages: list[dict] | None  # /v1/chat/completions
    max_tokens: int | None  # None: the plan's M
    stream: bool
    include_usage: bool
    return_token_ids: bool  # extension: each choice also carries the generated token ids
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one


MAX_STOPS = 4  # OpenAI's rule for `stop`


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(body: Any, chat: bool) -> CompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, "chat" if chat else "completions")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required (a string naming a served model)", "model")
    max_tokens = _max_tokens(body, chat)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    include_usage = _include_usage(body.get("stream_options"))
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool):
        raise ApiError(400, "'return_token_ids' must be true or false", "return_token_ids")
    stop = _stop(body.get("stop"))
    if chat:
        return CompletionRequest(
            model, None, _messages(body.get("messages")), max_tokens, stream, include_usage,
            return_ids, stop,
        )  # fmt: skip
    return CompletionRequest(
        model, _prompt(body.get("prompt")), None, max_tokens, stream, include_usage, return_ids,
        stop,
    )  # fmt: skip


def _check_fields(body: dict, endpoint: Endpoint) -> None:
    """Each field by the table (``serve.fields``): a refused one at a value that asks for
    something, or one the table does not know for this endpoint, is a 400 naming it and why."""
    known = fields_for(endpoint)
    for name, value in body.items():
        field = known.get(name)
        if field is None:
            other = BY_NAME.get(name)
            where = f"a field of {PATHS[other.endpoints[0]]} only" if other else "an unknown field"
            raise ApiError(
                400,
                f"{name!r} is {where}: this server refuses the fields it does not know "
                f"for {PATHS[endpoint]} (README Serving lists them)",
                name,
                "unknown_field",
            )
        if field.verdict in ("honoured", "ignored") or field.asks_nothing(value):
            continue
        shown = _short(value)
        if field.verdict == "greedy":
            raise ApiError(400, f"{name!r} = {shown} is {RECOMPILE}", name, "greedy_plan")
        raise ApiError(400, f"{name!r} = {shown} is not supported: {field.why}", name,
                       "unsupported_field")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise ApiError(400, "'stream_options.include_usage' must be true or false",
                       "stream_options")
    return value


def _stop(stop: Any) -> tuple[str, ...]:
    """OpenAI's ``stop``: a string or a list of up to 4 strings (null or [] for none)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' has {len(stops)} strings, at most {MAX_STOPS} are allowed",
                       "stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "'stop' holds an empty string, which would end every generation "
                       "before its first token", "stop")
    return tuple(stops)


def _max_tokens(body: dict, chat: bool) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise ApiError(400, f"'{name}' must be a positive integer, got {value!r}", name)
        return value
    return None


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "one prompt per request: batches of prompts are not supported", "prompt")
    raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ApiError(
                        400, f"messages[{i}]: only text content parts are supported", "messages"
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def refusal(model: str, err: RequestRefused, prompt_param: str = "prompt") -> ApiError:
    """The runner's refusal of a request (``runner.request.validate_request``, the one place the
    bounds are checked), worded for an API client: HTTP 400 naming the bound and the model."""
    if isinstance(err, PromptTooLong):
        return ApiError(
            400,
            f"the prompt has {err.value} tokens, more than the plan bound N = {err.bound} of model {model!r}",
            prompt_param,
            "prompt_too_long",
        )
    if isinstance(err, TooManyTokens) and err.value < 1:
        return ApiError(400, f"max_tokens must be at least 1, got {err.value}", "max_tokens")
    if isinstance(err, TooManyTokens):
        return ApiError(
            400,
            f"max_tokens {err.value} exceeds the plan bound M = {err.bound} of model {model!r}",
            "max_tokens",
            "max_tokens_too_large",
        )
    if isinstance(err, EmptyPrompt):
        return ApiError(400, "the prompt encodes to no tokens", prompt_param)
    if isinstance(err, TokenOutsideVocabulary):
        return ApiError(
            400,
            f"prompt token {err.index} is {err.value}, outside the vocabulary [0, {err.bound})",
            prompt_param,
        )
    return ApiError(400, str(err), prompt_param)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; a plan with a prefix pool also says how many prompt tokens came
    from it (``prompt_tokens_details.cached_tokens``, as OpenAI reports its prompt cache)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_body(rid: str, created: int, model: str, text: str, finish: str, use: dict,
                    token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": use}


def chat_body(rid: str, created: int, model: str, text: str, finish: str, use: dict,
              token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "finish_reason": finish, "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, use: dict) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
            "usage": use}
